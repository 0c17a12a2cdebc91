"""The host's bookkeeping of a call's rows (`hf_bole.generation.rows`), with the sequences' writes on the device
(`writes.py`) and the stopping rules they read (`stopping.py`): read back a round at a time, they emit and stop
exactly as token by token."""

from __future__ import annotations

import pytest
import torch

from tests.generation.test_loop import _char, _tokenizer


def test_stop_string_windows_past_a_finished_row():
    """A finished row's count may run past `max_new` by the rounds in flight (pipelined), so the stop strings'
    windows over its meaningless entries reach the spare last column. That column must hold a token id, not the -1
    of an accepted path's padding: the criterion embeds every id of its windows (on the CPU an IndexError, which
    ended eval/run.py's house runs at batch 8, depth 6, budget 32; on CUDA a device-side assert)."""
    from transformers.generation.stopping_criteria import StopStringCriteria

    from hf_bole.generation.rows import Rows
    from hf_bole.generation.stopping import Stopping
    from hf_bole.generation.writes import Writes

    P, max_new, pad = 4, 6, 0
    stopping = Stopping([StopStringCriteria(_tokenizer(), [_char(1) + _char(2)])], P)
    prompts = torch.full((2, P), pad)
    writes = Writes.for_call(None, prompts, P + max_new + 3, pad, stopping, graphed=False)  # 3 spare columns
    seq = writes.seq
    rows = Rows(2, P, max_new, stopping, writes)
    rows.generated.copy_(torch.tensor([max_new + 2, 1]))  # row 0 done; row 1 has its first token (in place)
    tokens = torch.tensor([[-1, -1, -1, -1, -1], [3, 1, 2, -1, -1]])  # [B, L]: -1 past each row's path
    written = rows.write(tokens, torch.tensor([0, 3]))
    assert seq[:, -1].tolist() == [pad, pad]
    assert seq[1, P + 1 : P + 4].tolist() == [3, 1, 2]
    stops = written.host[:, 1 + 5 :]  # [B, L] after the lengths and the tokens
    assert stops[1, :3].tolist() == [0, 0, 1]  # "bc" ends at row 1's third token


def test_replayed_writes_are_the_eager_writes(monkeypatch):
    """`Rows.write` replayed from graphs (`graphed`; a recorded call stands for the CUDA graph): the first write of a
    width runs eagerly, the second captures, later ones replay with the round's tokens copied in. The sequence, the
    rows' counts and what goes to the host (lengths, tokens, stop-string hits) equal eager writes' every round. The
    writes are kept for the model's next calls: one graph serves every round of that width in calls of other prompt
    lengths and new criteria objects of the same stop strings (the same tables or equal ones); other stop strings, a
    longer sequence or another batch size get writes of their own."""
    from transformers.generation.stopping_criteria import STOP_STRING_EMBEDDING_CACHE, StopStringCriteria

    from hf_bole.generation import graphs as graphs_module
    from hf_bole.generation.rows import Rows
    from hf_bole.generation.stopping import Stopping
    from hf_bole.generation.writes import Writes
    from tests.generation.recorded_graph import recording_queued_capture

    captured = []
    monkeypatch.setattr(graphs_module, "capture_queued", recording_queued_capture(captured))
    model = torch.nn.Module()  # the key the writes are kept under
    B, L, max_new, pad = 3, 5, 30, 0
    generator = torch.Generator(torch.get_default_device()).manual_seed(0)  # CUDA under HF_BOLE_TEST_DEVICE
    hits = 0
    kept = []
    for P in (4, 9, 6):
        if P == 6:  # tables of its own, equal: transformers 5.17 misses its cache when the vocabulary's order differs
            STOP_STRING_EMBEDDING_CACHE.clear()
        # new criteria every call, as `generate(stop_strings=...)` builds them: the same stop string and vocabulary
        criteria = [StopStringCriteria(_tokenizer(), [_char(1) + _char(2)])]
        stopping = Stopping(criteria, P)
        prompts = torch.randint(0, 4, (B, P), generator=generator)
        writes = [Writes.for_call(model, prompts, P + max_new + 8, pad, stopping, graphed=g) for g in (False, True)]
        kept.append(writes[1])
        rows = [Rows(B, P, max_new, stopping, w) for w in writes]
        for _ in range(4):
            tokens = torch.randint(0, 4, (B, L), generator=generator)  # ids 0-3: "bc" turns up
            lengths = torch.randint(0, L + 1, (B,), generator=generator)
            eager, replayed = (_arrived(r.write(tokens, lengths)).host.clone() for r in rows)
            assert torch.equal(replayed, eager)
            width = rows[0].seq.shape[1]  # the kept sequence is wider: its columns past the eager one's hold padding
            assert torch.equal(rows[1].seq[:, :width], rows[0].seq) and bool((rows[1].seq[:, width:] == pad).all())
            assert torch.equal(rows[1].generated, rows[0].generated)
            hits += int(eager[:, 1 + L :].sum())
    assert hits > 0
    assert kept[0] is kept[1] is kept[2]
    assert len(captured) == 1
    others = [StopStringCriteria(_tokenizer(), [_char(2) + _char(1)])]  # another stop string
    assert Writes.for_call(model, prompts, 40, pad, Stopping(others, 6), graphed=True) is not kept[0]
    stopping = Stopping(criteria, 6)
    assert Writes.for_call(model, prompts, 40, pad, stopping, graphed=True) is not kept[0]  # back to `criteria`
    renewed = Writes.for_call(model, prompts, 40, pad, stopping, graphed=True)
    assert Writes.for_call(model, prompts, 4000, pad, stopping, graphed=True) is not renewed
    assert Writes.for_call(model, prompts[:2], 40, pad, stopping, graphed=True) is not renewed


def _read_token_by_token(rows, written) -> list[int]:
    """`Rows.read` as plain decoding's rules read literally: every token in turn, the limit and each criterion asked
    again before it (the loop's form before it read a row at a time)."""
    stopping, host, L = rows.stopping, written.host.tolist(), written.width
    counted = []
    for b in range(rows.B):
        counted.append(0 if rows.frozen[b] or rows.n_gen[b] >= rows.limit() else host[b][0])
        for j in range(host[b][0]):
            if rows.frozen[b] or rows.n_gen[b] >= rows.limit():
                break
            token = host[b][1 + j]
            rows.tokens[b].append(token)
            rows.n_gen[b] += 1
            length = rows.P + rows.n_gen[b]
            stop = (written.suffix and bool(host[b][1 + L + j])) or token in stopping.eos
            stop = stop or any(length >= m for m in stopping.max_lengths)
            if rows.finished_at[b] is None and (
                stop or (bool(stopping.others) and bool(stopping.others(rows.seq[b : b + 1, :length], None).any()))
            ):
                rows.finished_at[b] = rows.n_gen[b]
                rows.frozen[b] = stopping.pads_finished
    return counted


@pytest.mark.parametrize("seed", range(6))
def test_rows_read_a_row_at_a_time_as_token_by_token(seed):
    """`Rows.read` emits, counts and stops rows exactly as reading token by token does, and calls a user criterion
    with the same ids in the same order: random rounds of EOS, stop-string hits, a max length, a user criterion
    that stops on one token id, with and without padding of finished rows."""
    from transformers.generation.stopping_criteria import (
        EosTokenCriteria,
        MaxLengthCriteria,
        StoppingCriteria,
        StoppingCriteriaList,
    )

    from hf_bole.generation.rows import Rows
    from hf_bole.generation.stopping import Stopping
    from hf_bole.generation.writes import Done, Writes, Written

    class StopsOn(StoppingCriteria):
        def __init__(self, token):
            self.token, self.calls = token, []

        def __call__(self, input_ids, scores, **kwargs):
            self.calls.append(input_ids.tolist())
            return input_ids[:, -1] == self.token

    B, P, L, max_new = 4, 3, 5, 14
    for pads in (True, False):
        states = []
        for read in (Rows.read, _read_token_by_token):
            user = StopsOn(7)
            criteria = [MaxLengthCriteria(P + max_new), user] + ([EosTokenCriteria(5)] if pads else [])
            stopping = Stopping(StoppingCriteriaList(criteria), P)
            prompts = torch.zeros(B, P, dtype=torch.long)
            writes = Writes.for_call(None, prompts, P + max_new + 3 * L, 0, stopping, False)
            seq = writes.seq
            rows = Rows(B, P, max_new, stopping, writes)
            draws = torch.Generator().manual_seed(seed + 100 * pads)
            counted = []
            while any(rows.active()):
                lengths = torch.randint(1, L + 1, (B,), generator=draws, device="cpu")
                tokens = torch.randint(3, 12, (B, L), generator=draws, device="cpu")
                hits = torch.rand(B, L, generator=draws, device="cpu") < 0.05  # what the stop strings would say
                for b in range(B):  # the criteria read the row's ids, which `write` puts in `seq`
                    n = min(rows.n_gen[b], seq.shape[1] - P - L)
                    seq[b, P + n : P + n + L] = tokens[b]
                host = torch.cat([lengths[:, None], tokens, hits.long()], dim=1)
                counted.append(read(rows, Written(host, Done(), L, True)))
            states.append((counted, rows.tokens, rows.n_gen, rows.finished_at, rows.frozen, user.calls))
        assert states[0] == states[1]
        assert any(f is not None for f in states[0][3])  # some row stopped inside a round


def _arrived(written):
    """`written` once its copy to the host has arrived (on a CUDA device it is queued, as `Rows.read` waits for it)."""
    written.ready.synchronize()
    return written
