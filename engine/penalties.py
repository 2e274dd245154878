"""Penalties and biases on a batch's logits, before temperature and sampling, as batch tensors (one
pass per kind over the rows that use it, no loop per row over the vocabulary).

- repetition (vLLM's meaning): a token seen in the prompt or the output has its logit divided by
  the penalty where positive, multiplied by it where not;
- frequency and presence (OpenAI's): `logit -= frequency x count + presence x (count > 0)`, counts
  over the output tokens only (a migrated request's re-prefilled output included:
  `SamplingParams.prompt_tokens`);
- logit_bias: added to the logits;
- min_tokens: EOS (unless ignore_eos) and the stop token ids set to -inf until that many tokens are
  out; a row where nothing else is allowed (a grammar that only lets EOS follow) keeps them.

Everything derives from the sequence's token ids, so a request sampled on two workers, or migrated,
gets the same penalties as in one process. vLLM's order: repetition, then frequency and presence;
the bias and the min_tokens mask come first, as its logits processors do.
"""

from __future__ import annotations

from typing import Collection, Sequence as Seq

import torch

from engine.sequence import Sequence


def apply_penalties(
    logits: torch.Tensor, seqs: Seq[Sequence], eos_token_ids: Collection[int]
) -> torch.Tensor:
    """fp32 `logits` [len(seqs), vocab] with each sequence's penalties applied (out of place: the
    model's logits are inference tensors). Rows whose params ask for nothing keep their values.

    Every pass touches only the token ids it concerns (gather, then scatter back), never the whole
    vocabulary: the ids are padded with the index of one extra column, dropped at the end, and a
    row that does not use a kind of penalty gets only padding and a neutral value for it."""
    if not any(seq.params.processes_logits for seq in seqs):
        return logits
    params = [seq.params for seq in seqs]
    vocab = logits.shape[-1]
    device = logits.device
    # the extra column takes the padding's writes
    x = torch.cat([logits, logits.new_zeros(len(seqs), 1)], dim=1)

    def values(name: str) -> torch.Tensor:
        return torch.tensor([getattr(p, name) for p in params], dtype=x.dtype, device=device)

    if any(p.logit_bias for p in params):
        ids = _padded([[t for t, _ in p.logit_bias] for p in params], vocab, device)
        biases = _padded([[b for _, b in p.logit_bias] for p in params], 0.0, device, x.dtype)
        x.scatter_add_(1, ids, biases)

    held = [
        row
        for row, (seq, p) in enumerate(zip(seqs, params))
        if len(seq.output_token_ids) < p.min_tokens
        # a grammar that allows nothing but a stop token keeps it
        and (seq.matcher is None or not _only_stops_allowed(x[row, :vocab], p, eos_token_ids))
    ]
    if held:
        stops = [_stop_ids(params[row], eos_token_ids) for row in held]
        rows = torch.tensor(
            [row for row, ids in zip(held, stops) for _ in ids], dtype=torch.long, device=device
        )
        cols = torch.tensor([t for ids in stops for t in ids], dtype=torch.long, device=device)
        x[rows, cols] = float("-inf")

    if any(p.repetition_penalty != 1.0 for p in params):
        ids = _padded(
            [seq.token_ids if p.repetition_penalty != 1.0 else [] for seq, p in zip(seqs, params)],
            vocab,
            device,
        )
        factor = values("repetition_penalty").unsqueeze(1)
        seen = x.gather(1, ids)  # a token seen twice is written twice, with the same value
        x.scatter_(1, ids, torch.where(seen > 0, seen / factor, seen * factor))

    if any(p.frequency_penalty != 0.0 or p.presence_penalty != 0.0 for p in params):
        ids = _padded(
            [
                p.output_so_far(seq.prompt_token_ids) + seq.output_token_ids
                if p.frequency_penalty != 0.0 or p.presence_penalty != 0.0
                else []
                for seq, p in zip(seqs, params)
            ],
            vocab,
            device,
        )
        frequency = values("frequency_penalty").unsqueeze(1).expand(ids.shape)
        x.scatter_add_(1, ids, -frequency)  # once per occurrence
        presence = values("presence_penalty").unsqueeze(1)
        x.scatter_(1, ids, x.gather(1, ids) - presence)  # once per token
    return x[:, :vocab]


def _stop_ids(params, eos_token_ids: Collection[int]) -> list[int]:
    return list(params.stop_token_ids) + ([] if params.ignore_eos else list(eos_token_ids))


def _only_stops_allowed(row: torch.Tensor, params, eos_token_ids: Collection[int]) -> bool:
    allowed = torch.isfinite(row)
    allowed[_stop_ids(params, eos_token_ids)] = False
    return not bool(allowed.any())


def _padded(lists: Seq[Seq], pad, device, dtype: torch.dtype = torch.long) -> torch.Tensor:
    """A [len(lists), longest (at least 1)] tensor of the lists padded with `pad`: the column past
    the vocabulary, which the callers drop, for ids."""
    width = max(1, max(len(items) for items in lists))
    return torch.tensor(
        [list(items) + [pad] * (width - len(items)) for items in lists], dtype=dtype, device=device
    )
