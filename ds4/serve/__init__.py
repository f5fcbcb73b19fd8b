"""`ds4 serve`: an OpenAI- and Anthropic-compatible HTTP head over one engine session.

  prompt.py      requests' messages -> DS4 chat prompt parts -> token ids
  tools.py       DS4's DSML tool-call markup: the schema prompt, rendering, parsing
  stops.py       stop strings matched across token boundaries
  reply.py       generated tokens -> reasoning / answer / tool-call channels
  driver.py      the one generation thread, its bounded queue, prompt reuse, cancellation
  metrics.py     Prometheus counters and gauges
  shared.py      what both APIs share: request errors, limits, waiting for a job's events
  openai_api.py  /v1/models, /v1/chat/completions, /v1/completions
  anthropic_api.py  /v1/messages, /v1/messages/count_tokens
  app.py         the FastAPI application: auth, limits, errors, /health, /metrics
"""

DEFAULT_MAX_BODY = 8 << 20  # bytes; a long agent history fits, a runaway upload does not
