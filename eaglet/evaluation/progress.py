"""eval's progress bar: the new tokens a phase of an evaluation decodes, with the prompt it is at
and its running figures (tau, the lossless count). Used by decoding.py and replaying.py; change
it to show other figures while eval decodes."""

from __future__ import annotations

import sys

from tqdm import tqdm

from ..distributed import dist_env


class ProgressBar:
    """eval's progress, a tqdm bar as extract's and train's: the new tokens a phase decodes (its
    total shrinks by what a prompt's early EOS leaves undecoded), the prompt it is at and the
    running figures in its postfix. Shown when `show`, under torchrun on rank 0 only; without a
    `desc` (no phase running) it counts nothing."""

    def __init__(self, desc: str = "", prompts: int = 0, total: int = 0, show: bool = False):
        self.prompts = prompts
        self.shown = bool(desc) and show and dist_env().is_main
        self.tqdm = tqdm(total=total, desc=desc, unit="tok", dynamic_ncols=True, disable=not self.shown) if desc else None
        self.at: dict[str, str] = {}  # the prompt it is at and which decode
        self.postfix: dict[str, str] = {}  # the running figures

    def update(self, n: int) -> None:
        if self.tqdm is not None:
            self.tqdm.update(n)

    def warming_up(self, done: bool = False) -> None:
        """The warm-up runs (or ran: the clock starts again, so that the rate and the ETA leave it out)."""
        if self.tqdm is None:
            return
        if done:
            self.at.pop("decoding", None)
            self.tqdm.reset(total=self.tqdm.total)
        else:
            self.at["decoding"] = "warm-up"
        self.show_postfix()

    def prompt(self, i: int, what: str = "") -> None:
        """Prompt `i` (1-based, as the plot and the messages number them) starts; `what`: which decode."""
        self.at = {"prompt": f"{i}/{self.prompts}", **({"decoding": what} if what else {})}
        self.show_postfix()

    def batch(self, first: int, last: int, what: str) -> None:
        """Prompts `first` to `last` (1-based) run together (replay's batches); `what`: which part."""
        self.at = {"prompts": f"{first}-{last}/{self.prompts}", "decoding": what}
        self.show_postfix()

    def ended(self, undecoded: int) -> None:
        """A decode ended `undecoded` tokens short of max_new_tokens (an EOS): the total drops by them."""
        if self.tqdm is not None and undecoded > 0:
            self.tqdm.total -= undecoded
        self.show_postfix()

    def show_postfix(self) -> None:
        if self.tqdm is not None:
            self.tqdm.set_postfix({**self.at, **self.postfix}, refresh=False)

    def write(self, line: str) -> None:
        """A line above the bar (a mismatch), when the bar is shown."""
        if self.shown:
            tqdm.write(line, file=sys.stderr)

    def close(self) -> None:
        if self.tqdm is not None:
            self.tqdm.close()
