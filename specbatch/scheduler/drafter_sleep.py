"""When the drafter sleeps: after ``SLEEP_AFTER`` policy calls in a row that wanted no drafts,
with two requests or more running, every running request and every one admitted while it sleeps
is ``drafter_off`` (it drafts nothing for the rest of its run and its drafter keeps nothing of
it), so the policy is neither asked nor told and a step is plain decoding. It wakes once the
running requests are half as many as when it fell asleep, or after ``WAKE_AFTER`` steps."""

from __future__ import annotations

from specbatch.request import Request

SLEEP_AFTER = 16  # policy calls in a row wanting no drafts before the drafter sleeps
WAKE_AFTER = 512  # steps it sleeps at most


class DrafterSleep:
    def __init__(self, draft_input: str) -> None:
        self.draft_input = draft_input  # "none": no drafter to put to sleep
        self.quiet = 0  # policy calls in a row that wanted no drafts
        self.asleep_with: int | None = None  # running requests when it fell asleep
        self.slept = 0  # steps asleep

    @property
    def asleep(self) -> bool:
        return self.asleep_with is not None

    def wanted(self, drafts: bool, running: list[Request]) -> None:
        """After a policy call: whether it wanted any drafts."""
        self.quiet = 0 if drafts else self.quiet + 1
        if self.quiet < SLEEP_AFTER or self.draft_input == "none" or len(running) < 2:
            return
        self.asleep_with, self.slept, self.quiet = len(running), 0, 0
        for req in running:
            req.drafter_off = True

    def tick(self, running: int) -> None:
        """Once a step, with the requests running: wakes when due."""
        if self.asleep_with is None:
            return
        self.slept += 1
        if running <= self.asleep_with // 2 or self.slept >= WAKE_AFTER:
            self.asleep_with = None

    def admitted(self, req: Request) -> None:
        """A request admitted while the drafter sleeps has it off."""
        if self.asleep_with is not None:
            req.drafter_off = True
