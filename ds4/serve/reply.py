"""Generated tokens -> the reply's channels: reasoning (before </think> in a think mode), the
answer, and DS4 tool-call markup (parsed into calls at the end, never streamed as text).

Stop strings apply to the reasoning and the answer, each on its own; the answer's trailing
newlines are held back until more answer text follows, so that the blank line that opens a
tool-call block is not streamed as answer.
"""

from __future__ import annotations

from ds4.core.tokenizer import Tokenizer

from .stops import StopMatcher
from .tools import TOOL_CALLS_CLOSE, TOOL_CALLS_OPEN, ToolCall, split_tool_calls

REASONING = "reasoning"
CONTENT = "content"


class ReplyStream:
    def __init__(self, tokenizer: Tokenizer, *, think: bool, stops: list[str] = (),
                 tools: bool = False):
        self.tokenizer = tokenizer
        self.channel = REASONING if think else CONTENT
        self.stops = list(stops)
        self.tools = tools
        self._decoder = tokenizer.stream_decoder()
        self._matcher = self._new_matcher()
        self._newlines = ""  # the answer's trailing newlines, held back
        self.tool_text: str | None = None  # the markup after TOOL_CALLS_OPEN, once it began
        self.stop_hit: str | None = None
        self.done = False  # a stop string or the end of a tool-call block: generate no more
        self.text = {REASONING: "", CONTENT: ""}

    def _new_matcher(self) -> StopMatcher:
        markers = [TOOL_CALLS_OPEN] if self.tools and self.channel == CONTENT else []
        return StopMatcher(self.stops + markers)

    def push(self, token: int) -> list[tuple[str, str]]:
        """The (channel, text) pieces one more token completes."""
        tok = self.tokenizer
        if self.done:
            return []
        if self.tool_text is not None:
            self.tool_text += self._decoder.push(token)
            if TOOL_CALLS_CLOSE in self.tool_text:
                self.done = True
            return []
        if token == tok.think_end_id and self.channel == REASONING:
            out = self._emit(self._matcher.push(self._decoder.flush()))
            out += self._emit(self._matcher.flush())
            self.channel = CONTENT
            self._matcher = self._new_matcher()
            return out
        return self._emit(self._matcher.push(self._decoder.push(token)))

    def _emit(self, text: str) -> list[tuple[str, str]]:
        out = []
        hit = self._matcher.hit
        if hit is not None and hit == TOOL_CALLS_OPEN and self.tool_text is None:
            self.tool_text = self._matcher.after
        elif hit is not None and self.stop_hit is None:
            self.stop_hit = hit
            self.done = True
        if self.channel == CONTENT:
            text = self._newlines + text
            body = text.rstrip("\n")
            self._newlines = text[len(body):]
            text = body
        if text:
            self.text[self.channel] += text
            out.append((self.channel, text))
        return out

    def finish(self) -> tuple[list[tuple[str, str]], list[ToolCall]]:
        """The last pieces (what was held back) and the tool calls of the markup, if any."""
        if self.tool_text is not None:
            _, calls = split_tool_calls(TOOL_CALLS_OPEN + self.tool_text + self._decoder.flush())
            return [], calls
        out = []
        if not self.done:
            out = self._emit(self._matcher.push(self._decoder.flush()))
            out += self._emit(self._matcher.flush())
        if self.channel == CONTENT and self._newlines:
            self.text[CONTENT] += self._newlines
            out.append((CONTENT, self._newlines))
        self._newlines = ""
        return out, []
