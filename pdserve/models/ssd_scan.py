"""The selective state-space recurrence of Mamba2 over a flat batch: a chunked scan for prefill rows
and a one-step update for decode rows, both in float32 and both leaving the same state.

Per head h (head_dim P, state N, its group's B and C), row t of a sequence, with a_t = dt_t * A_h < 0:

    state_t = exp(a_t) * state_{t-1} + dt_t * x_t (outer) B_t          [P, N]
    y_t     = state_t . C_t                                             [P]   (the D skip is the caller's)

The chunked form cuts each sequence into chunks of `chunk_tokens` rows and, with cum_t the running
sum of a within the chunk, splits y_t into the chunk's own rows and the state the chunk starts from:

    y_t       = sum_{s <= t in chunk} exp(cum_t - cum_s) (C_t . B_s) dt_s x_s  +  exp(cum_t) C_t . start
    end state = exp(cum_last) start + sum_s exp(cum_last - cum_s) dt_s x_s (outer) B_s

Only the chunk-to-chunk hand-over of states is sequential (one step per chunk, all sequences at
once); everything else is batched matmuls over all chunks of all sequences. The chunk length
changes the rounding only, never the maths.

    flat rows   | seq 0: 150 rows             | seq 1: 3 rows |
    chunks (64) | c0 (64) | c1 (64) | c2 (22+pad)| c3 (3+pad)    |  pad rows: dt = 0, x = 0
"""

from __future__ import annotations

from typing import Sequence

import torch

SCAN_CHUNK_TOKENS = 64


def _heads_of_groups(t: torch.Tensor, num_heads: int) -> torch.Tensor:
    """[..., groups, N] -> [..., heads, N]: head h reads group h // (heads / groups)."""
    return t.repeat_interleave(num_heads // t.shape[-2], dim=-2)


def ssd_step(
    state: torch.Tensor, x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor, C: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One row per sequence. state [S, H, P, N], x [S, H, P], dt [S, H] (after softplus and limits),
    A [H], B and C [S, G, N] -> (y [S, H, P], new state [S, H, P, N]), float32."""
    num_heads = x.shape[1]
    dt = dt.float()
    B_h, C_h = _heads_of_groups(B.float(), num_heads), _heads_of_groups(C.float(), num_heads)
    decay = torch.exp(dt * A.float())  # [S, H]
    update = (dt.unsqueeze(-1) * x.float()).unsqueeze(-1) * B_h.unsqueeze(-2)  # [S, H, P, N]
    state = state.float() * decay[..., None, None] + update
    y = torch.einsum("shpn,shn->shp", state, C_h)
    return y, state


def _chunk_layout(sequence_starts: Sequence[int], chunk_tokens: int) -> tuple[list[int], list[int], list[int]]:
    """(row of each chunk slot or -1 for padding, first chunk of each sequence, chunks of each sequence)."""
    slots: list[int] = []
    first_chunk: list[int] = []
    num_chunks: list[int] = []
    for start, end in zip(sequence_starts[:-1], sequence_starts[1:]):
        count = -(-(end - start) // chunk_tokens)
        first_chunk.append(len(slots) // chunk_tokens)
        num_chunks.append(count)
        rows = list(range(start, end))
        slots.extend(rows + [-1] * (count * chunk_tokens - len(rows)))
    return slots, first_chunk, num_chunks


def _hand_over_states(
    initial: torch.Tensor, chunk_decay: torch.Tensor, chunk_states: torch.Tensor,
    first_chunk: list[int], num_chunks: list[int],
) -> tuple[torch.Tensor, torch.Tensor]:
    """The state each chunk starts from [chunks, H, P, N] and each sequence's final state [S, H, P, N]:
    chunk k + 1 of a sequence starts from decay_k * start_k + chunk_states_k."""
    device = initial.device
    states = initial.clone()
    starts = torch.empty_like(chunk_states)
    for k in range(max(num_chunks)):
        live = [i for i, count in enumerate(num_chunks) if count > k]
        chunk_ids = torch.tensor([first_chunk[i] + k for i in live], device=device)
        if len(live) == len(num_chunks):
            starts[chunk_ids] = states
            states = chunk_decay[chunk_ids][..., None, None] * states + chunk_states[chunk_ids]
            continue
        seq_ids = torch.tensor(live, device=device)
        current = states[seq_ids]
        starts[chunk_ids] = current
        states[seq_ids] = chunk_decay[chunk_ids][..., None, None] * current + chunk_states[chunk_ids]
    return starts, states


def ssd_chunked_scan(
    x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor, C: torch.Tensor,
    sequence_starts: Sequence[int], initial_states: torch.Tensor, chunk_tokens: int = SCAN_CHUNK_TOKENS,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows of several sequences. x [rows, H, P], dt [rows, H] (after softplus and limits), A [H],
    B and C [rows, G, N], initial_states [S, H, P, N] -> (y [rows, H, P], final states [S, H, P, N]),
    float32."""
    num_rows, num_heads, head_dim = x.shape
    slots, first_chunk, num_chunks = _chunk_layout(sequence_starts, chunk_tokens)
    slot_rows = torch.tensor(slots, device=x.device)
    real = slot_rows >= 0
    gather = slot_rows.clamp(min=0)

    def chunked(t: torch.Tensor) -> torch.Tensor:  # [rows, ...] -> [chunks, Q, ...], pad rows zero
        t = t.float()[gather] * real.view(-1, *([1] * (t.dim() - 1)))
        return t.view(-1, chunk_tokens, *t.shape[1:])

    xc, dtc = chunked(x), chunked(dt)  # [c, Q, H, P], [c, Q, H]
    Bc, Cc = _heads_of_groups(chunked(B), num_heads), _heads_of_groups(chunked(C), num_heads)  # [c, Q, H, N]
    cum = torch.cumsum(dtc * A.float(), dim=1)  # [c, Q, H]
    dx = xc * dtc.unsqueeze(-1)  # dt_s x_s

    # Rows within the chunk: a causal, decayed "attention" of C_t over B_s.
    causal = torch.ones(chunk_tokens, chunk_tokens, dtype=torch.bool, device=x.device).tril()
    gaps = cum.unsqueeze(2) - cum.unsqueeze(1)  # [c, t, s, H] = cum_t - cum_s
    decay = torch.exp(gaps.masked_fill(~causal[None, :, :, None], float("-inf")))
    scores = torch.einsum("cthn,cshn->ctsh", Cc, Bc) * decay
    y = torch.einsum("ctsh,cshp->cthp", scores, dx)

    # What each chunk adds to the state, and how the state it starts from decays across it.
    to_end = torch.exp(cum[:, -1:] - cum)  # [c, Q, H]
    chunk_states = torch.einsum("csh,cshp,cshn->chpn", to_end, dx, Bc)
    starts, final = _hand_over_states(initial_states.float(), torch.exp(cum[:, -1]), chunk_states,
                                      first_chunk, num_chunks)
    y = y + torch.einsum("cthn,chpn->cthp", Cc, starts) * torch.exp(cum).unsqueeze(-1)

    out = torch.empty(num_rows, num_heads, head_dim, dtype=torch.float32, device=x.device)
    out[slot_rows[real]] = y.reshape(-1, num_heads, head_dim)[real]
    return out, final
