"""The round's token bookkeeping as of this session's second commit (`_Rows.write` with 8 fewer launches and
dispatches, `_Rows.read` a row at a time) against the forms before it (`3b1b079`: token by token, the stop strings'
windows and positions rebuilt every round), for bole and tree-serial, in one process, passes in turns
(`eval/ab_turns.py`). Arguments: eval/run.py's. Not run in the thirty-third session (its device time was spent):

    python results/speed_h200/thirty_third_session/ab_host.py --datasets mbpp --num-prompts 8 --max-new-tokens 128 \\
        --batch-sizes 8 --depth 6 --repeats 10

The "before" variants put the earlier methods on the loop's classes; both share every graph. Their write and
stop-string windows are `3b1b079`'s; their read is the tests' token-by-token reader (`_read_token_by_token`), the same
rules as `3b1b079`'s read without its closure and `_Stopping.__call__` per token, so it is if anything a little faster
than the read it stands for.
"""

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))

from eval import ab_turns  # noqa: E402
from hf_bole.generation import loop  # noqa: E402
from tests.generation.test_loop import _read_token_by_token  # noqa: E402  (the token-by-token form, tested against)

NOW = (loop._Rows.write, loop._Rows.read, loop._Stopping.suffix_stops)


def suffix_stops(self, seq, ends):
    if not self.suffix:
        return None
    B, L = ends.shape
    columns = ends[..., None] - self.window + torch.arange(self.window, device=seq.device)
    windows = seq.gather(1, columns.clamp(0, seq.shape[1] - 1).view(B, -1)).view(B * L, self.window)
    stops = torch.zeros(B * L, dtype=torch.bool, device=seq.device)
    for criterion in self.suffix:
        stops |= criterion(windows, None)
    return stops.view(B, L)


def write(self, tokens, lengths):
    B, L = tokens.shape
    start = self.generated
    steps = torch.arange(L, device=tokens.device)
    real = steps[None, :] < lengths[:, None]
    col = torch.where(real, self.P + start[:, None] + steps, self.seq.shape[1] - 1)
    self.seq.scatter_(1, col, torch.where(real, tokens, self.pad))
    suffix = self.stopping.suffix_stops(self.seq, self.P + start[:, None] + steps + 1)
    self.generated = start + lengths
    parts = [lengths[:, None], tokens] + ([suffix.long()] if suffix is not None else [])
    host = torch.cat(parts, dim=1).to("cpu", non_blocking=True)
    ready = torch.cuda.Event() if tokens.is_cuda else loop._Done()
    ready.record()
    return loop._Written(host, ready, L, suffix is not None)


def read(self, written):
    written.ready.synchronize()
    return _read_token_by_token(self, written)


def variant(methods, settings: dict):
    def apply(model) -> dict:
        loop._Rows.write, loop._Rows.read, loop._Stopping.suffix_stops = methods
        return dict(settings)

    return apply


if __name__ == "__main__":
    variants = {}
    for mode, settings in (("bole", {}), ("tree-serial", {"bole_verify": "serial"})):
        variants[f"{mode} before"] = variant((write, read, suffix_stops), settings)
        variants[f"{mode} now"] = variant(NOW, settings)
    ab_turns.main("host", variants, sys.argv[1:])
