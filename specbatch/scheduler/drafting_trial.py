"""Whether drafting pays at a batch size, measured over whole stretches of steps.

The draft controller prices each step from what its passes cost. Where drafts stop paying,
drafting and plain decoding differ by a few percent, less than what a step's price leaves out:
the steps without drafts it times run between drafting steps (the drafter's weights in the
caches), and drafting changes when a batch's requests end, and with it how the prompts that
follow share steps with the others' decoding. So, with two requests or more running
(``level``: one per doubling), the engine also compares the two directly. After a stretch of
``EPOCH`` steps at a level in which most steps drafted, the drafter sleeps for one (its
requests decode plainly; ``SETTLE`` steps after the switch are not counted), and the output
tokens a second of the two stretches are compared. Unless drafting made more than ``MARGIN``
more, the drafter sleeps on at that level for ``interval`` stretches, then drafts for one and
is tried again (where the two are about even, plain decoding, which cannot lose, is kept);
else drafting goes on for ``interval`` stretches before the next trial. A
level's interval doubles while its verdict stands (up to ``MAX_INTERVAL``) and starts again at
one when it turns; leaving the level ends a trial or a hold. With ``auto`` only: a fixed draft
length is the user's. Coming back to a level where plain decoding won, the drafter sleeps at once.
"""

from __future__ import annotations

from dataclasses import dataclass

from specbatch.request import Request
from specbatch.scheduler.drafter_lag import DrafterLag

EPOCH = 256  # steps a regime is measured over
SETTLE = 32  # steps after a switch left out (requests admitted before it run the old way)
MARGIN = 0.02  # how far drafting must be ahead for it to go on
MAX_INTERVAL = 64  # stretches between two trials at most


def level(running: int) -> int:
    """Batch sizes compared alike: 2-3, 4-7, 8-15, ... (0: one request)."""
    return max(running, 1).bit_length() - 1


@dataclass
class _Stretch:
    """Steps counted at one level in one regime."""

    level: int
    asleep: bool
    skip: int = SETTLE
    steps: int = 0
    drafting: int = 0
    tokens: int = 0
    seconds: float = 0.0

    @property
    def rate(self) -> float:
        return self.tokens / max(self.seconds, 1e-9)


@dataclass
class _Level:
    interval: int = 1  # stretches of the standing verdict before the next trial
    done: int = 0  # stretches of it since the last trial
    plain: bool = False  # the standing verdict: plain decoding made more
    drafting_rate: float | None = None  # output tokens a second of its last drafting stretch


def batch_range(n: int) -> str:
    """Level ``n``'s batch sizes, as ``4-7``."""
    return f"{2**n}-{2 ** (n + 1) - 1}"


class DraftingTrial:
    def __init__(self) -> None:
        self.levels: dict[int, _Level] = {}
        # batch sizes -> (drafting's, plain decoding's) output tokens a second at the last trial
        self.measured: dict[str, tuple[float, float]] = {}
        self.stretch: _Stretch | None = None
        self.trial = False  # the drafter sleeps for a trial
        self.hold = False  # the drafter sleeps on a verdict for plain decoding

    def step(
        self,
        lag: DrafterLag,
        running: list[Request],
        batch: int,
        tokens: int,
        seconds: float,
        drafted: bool,
    ) -> None:
        """After an engine step of ``batch`` requests that emitted ``tokens`` in ``seconds``
        (``drafted``: whether any drafted); ``running``: the requests running after it."""
        n = level(batch)
        s = self.stretch
        if s is not None and (s.level != n or s.asleep != lag.asleep):
            # the batch left the level, or the drafter fell asleep or woke on its own
            if self.trial or self.hold:
                self.trial = self.hold = False
                if lag.asleep:
                    lag.wake()
            s = self.stretch = None
        if not n:
            return
        if s is None:
            lv = self.levels.get(n)
            if lv is not None and lv.plain and not lag.asleep:  # back where plain decoding won
                self.hold, lv.done = True, 0
                lag.sleep_for((lv.interval + 1) * EPOCH, running)
            s = self.stretch = _Stretch(n, lag.asleep)
        if s.skip:
            s.skip -= 1
            return
        s.steps += 1
        s.drafting += drafted
        s.tokens += tokens
        s.seconds += seconds
        if s.steps >= EPOCH:
            self._stretch_done(lag, running, s)

    def _stretch_done(self, lag: DrafterLag, running: list[Request], s: _Stretch) -> None:
        lv = self.levels.setdefault(s.level, _Level())
        self.stretch = _Stretch(s.level, s.asleep, skip=0)
        if not s.asleep:
            if 2 * s.drafting < s.steps:  # the controller itself chose plain decoding
                return
            lv.drafting_rate = s.rate
            lv.done += 1
            if lv.plain or lv.done >= lv.interval:  # try plain decoding
                self.trial = True
                lag.sleep_for(SETTLE + 2 * EPOCH, running)  # woken when the trial ends
                self.stretch = _Stretch(s.level, True)
            return
        if self.hold:
            lv.done += 1
            if lv.done >= lv.interval:  # draft again for a stretch, then a trial
                self.hold = False
                lag.wake()
                self.stretch = _Stretch(s.level, False)
            return
        if not self.trial:
            return
        self.trial = False
        assert lv.drafting_rate is not None  # a trial follows a drafting stretch
        self.measured[batch_range(s.level)] = (lv.drafting_rate, s.rate)
        plain = lv.drafting_rate <= s.rate * (1 + MARGIN)
        lv.interval = min(2 * lv.interval, MAX_INTERVAL) if plain == lv.plain else 1
        lv.plain, lv.done = plain, 0
        if plain:
            self.hold = True
            lag.sleep_for((lv.interval + 1) * EPOCH, running)  # woken when the hold ends
        else:
            lag.wake()
            self.stretch = _Stretch(s.level, False)
