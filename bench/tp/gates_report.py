"""bench_gates.py's record: the machine, the statistics, the CSV / JSON files and the printout.

A record is a dict: the CSV's COLUMNS plus `details` (what only the JSON keeps). The decode
statistics are the leader's (rank 0's) per-token times; the bulk GB/s counts the partial
payload one rank sends in a prefill chunk (the link carries as much the other way at once).
"""

from __future__ import annotations

import csv
import json
import os
import platform
import re
import socket
import subprocess
import sys
from datetime import datetime, timezone
from pathlib import Path

import numpy as np

TARGET_MS = 3.0  # issue #33 point 8: the gates may add at most this much to a token (median)
GATES_PER_LAYER = 2  # ATTN, FFN
F32_BYTES = 4

COLUMNS = ["date", "machine", "cores", "device", "transport", "n_layer", "n_embd", "rows",
           "tokens", "ms_median", "ms_p90", "ms_p99", "target_ms", "pass", "bulk_rows",
           "bulk_chunks", "bulk_ms_median", "bulk_gb_s"]


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def gpu_names() -> list[str]:
    """The visible CUDA devices' names ([] without torch or CUDA)."""
    try:
        import torch
    except ImportError:
        return []
    return [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]


def device_label(transport: str, n_rank: int) -> str:
    if transport != "nccl":
        return "cpu"
    names = gpu_names()[:n_rank]
    return f"{names[0]} x{len(names)}" if names else "cuda"


def summarize(cfg, ranks: dict, n_rank: int) -> dict:
    """The record of one pair's run (`cfg`: bench_gates.Config; `ranks`: run_rank's results)."""
    lead = np.array(ranks[0]["decode_s"]) * 1e3  # the leader's tokens: what a user waits on
    med, p90, p99 = (float(v) for v in np.percentile(lead, [50, 90, 99]))
    gates = GATES_PER_LAYER * cfg.n_layer
    rec = {"date": datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%MZ"), "machine": cpu_model(),
           "cores": os.cpu_count(), "device": device_label(cfg.transport, n_rank),
           "transport": cfg.transport, "n_layer": cfg.n_layer, "n_embd": cfg.n_embd, "rows": 1,
           "tokens": cfg.tokens, "ms_median": round(med, 4), "ms_p90": round(p90, 4),
           "ms_p99": round(p99, 4), "target_ms": TARGET_MS,
           "pass": "pass" if med <= TARGET_MS else "fail", "bulk_rows": "", "bulk_chunks": 0,
           "bulk_ms_median": "", "bulk_gb_s": ""}  # (bulk: blank where it was not measured)
    if cfg.bulk_chunks:
        chunk_s = float(np.median(ranks[0]["bulk_s"]))
        sent = gates * cfg.bulk_rows * cfg.n_embd * F32_BYTES  # one rank, one chunk
        rec["bulk_rows"], rec["bulk_chunks"] = cfg.bulk_rows, cfg.bulk_chunks
        rec["bulk_ms_median"] = round(chunk_s * 1e3, 2)
        rec["bulk_gb_s"] = round(sent / chunk_s / 1e9, 3)
    rec["details"] = {
        "warmup_tokens": cfg.warmup, "bulk_warmup_chunks": cfg.bulk_warmup,
        "gates_per_token": gates, "us_per_gate_median": round(med * 1e3 / gates, 2),
        "ms_mean": round(float(lead.mean()), 4), "ms_min": round(float(lead.min()), 4),
        "ms_max": round(float(lead.max()), 4),
        "rank1_ms_median": round(float(np.median(ranks[1]["decode_s"])) * 1e3, 4),
        "bulk_chunk_ms": [round(s * 1e3, 2) for s in ranks[0]["bulk_s"]],
        "loadavg": list(os.getloadavg()), "python": platform.python_version(),
        "numpy": np.__version__, "torch": _torch_version(), "host": socket.gethostname(),
        "commit": source_commit(),
    }
    return rec


def source_commit() -> str:
    """The checkout's commit, "+dirty" where ds4/ differs from it: the gate code measured."""
    root = Path(__file__).resolve().parents[2]
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=root, text=True,
                              capture_output=True, check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--", "ds4"], cwd=root, text=True,
                               capture_output=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return ""
    return head + ("+dirty" if dirty else "")


def _torch_version() -> str:
    mod = sys.modules.get("torch")  # (only where this run imported it)
    return getattr(mod, "__version__", "") if mod else ""


def machine_slug() -> str:
    """The results' name: the GPUs where there are some, else the CPU and its cores."""
    names = gpu_names()
    label = f"{names[0]}-x{len(names)}" if names else f"cpu-{cpu_model()}-x{os.cpu_count()}"
    return re.sub(r"[^a-z0-9]+", "-", label.lower()).strip("-")


def csv_row(rec: dict) -> dict:
    return {k: rec[k] for k in COLUMNS}


def write_results(records: list[dict], out_dir: Path, name: str) -> tuple[Path, Path]:
    """Merge into gates-<name>.csv/.json: this run's transports replace their old rows, the
    others stay (so transports measured at different times share one file)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    csv_path, json_path = out_dir / f"gates-{name}.csv", out_dir / f"gates-{name}.json"
    mine = {r["transport"] for r in records}
    old = json.loads(json_path.read_text()) if json_path.exists() else []
    merged = [r for r in old if r["transport"] not in mine] + records
    json_path.write_text(json.dumps(merged, indent=1) + "\n")
    with csv_path.open("w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=COLUMNS)
        w.writeheader()
        w.writerows(csv_row(r) for r in merged)
    return csv_path, json_path


def print_record(rec: dict) -> None:
    d = rec["details"]
    print(f"{rec['transport']:>6}  {rec['n_layer']} layers × 2 gates × [1, {rec['n_embd']}] f32, "
          f"{rec['tokens']} tokens: median {rec['ms_median']:.3f} ms, p90 {rec['ms_p90']:.3f}, "
          f"p99 {rec['ms_p99']:.3f} ms a token ({d['us_per_gate_median']:.1f} µs a gate)")
    if len(d.get("repeat_ms_median", [])) > 1:
        print(f"        medians of {len(d['repeat_ms_median'])} runs (the lowest kept): "
              + ", ".join(f"{m:.3f}" for m in d["repeat_ms_median"]) + " ms")
    verdict = "PASS" if rec["pass"] == "pass" else "FAIL"
    print(f"        target ≤ {rec['target_ms']:g} ms a token (median): {verdict}")
    if rec["bulk_chunks"]:
        print(f"        bulk: {rec['bulk_rows']} rows a record, {rec['bulk_ms_median']} ms a chunk "
              f"(median of {rec['bulk_chunks']}), {rec['bulk_gb_s']} GB/s sent by each rank")
