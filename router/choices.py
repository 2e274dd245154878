"""`n > 1` and `best_of` (the OpenAI API's several choices of one prompt): each choice is a request
of its own through the router, so migration, abort, structured outputs and logprobs work per choice
as they do for one request, and the engine knows nothing of choices.

The choices share the prompt's KV through the prefix caches that exist already. Choice 0 runs first;
once its first decoded chunk is back (its prompt's full blocks are then in its prefill worker's
cache and installed on its decode worker), choices 1.. start together, pinned to choice 0's workers
(`Router.generate`'s `pinned_to`): the prefill worker computes only the prompt's last partial block
again, and the decode worker's reservation reuses the full blocks choice 0 holds (`reused_blocks`,
not shipped), so they are held once.

Choice i runs as request `<id>#i` with seed `seed + i` (mod 2**63) when a seed was given, so each
choice is reproducible alone by sending its seed with n=1; without a seed each samples on its own.
With best_of > n every choice samples its tokens' logprobs (`logprobs=0` when none were asked), and
the caller keeps the n of the highest cumulative logprob (`best`, vLLM's rule).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
from typing import AsyncIterator, NamedTuple, Optional, Sequence

from router.output import StreamItem
from router.registry import Route, choice_request_id
from router.router import Router
from router.validation import ValidatedRequest

MAX_CHOICES = (
    16  # n and best_of: at most this many (vLLM has no limit; ours keeps one request small)
)
_SEED_MODULUS = 2**63  # the API's seed range


class Choices(NamedTuple):
    n: int = 1  # choices returned
    best_of: int = 1  # choices generated (>= n): the n of highest cumulative logprob are returned


def choice_request(
    request: ValidatedRequest, index: int, sample_logprobs: bool, position: Optional[int] = None
) -> ValidatedRequest:
    """Choice `index` of `request`: its derived seed and its tokens' logprobs if `sample_logprobs`;
    it runs as the request's choice `position` (default `index`: a batch of prompts numbers its
    choices across prompts, prompt i's choice j at i x best_of + j)."""
    params = request.params
    changes: dict = {}
    if index and params.seed is not None:
        changes["seed"] = (params.seed + index) % _SEED_MODULUS
    if sample_logprobs and params.logprobs is None:
        changes["logprobs"] = 0
    position = index if position is None else position
    request_id = choice_request_id(request.request_id, position)
    if not changes and not position:
        return request
    return ValidatedRequest(request_id, request.prompt_ids, dataclasses.replace(params, **changes))


async def generate_choices(
    router: Router, prompts: Sequence[ValidatedRequest], choices: Choices
) -> AsyncIterator[tuple[int, StreamItem]]:
    """Streams `(choice index, item)` of all `choices.best_of` choices of each prompt (a batch of
    prompts: prompt i's choice j has index i x best_of + j; each prompt's choices share their
    seeds and KV as one prompt's do), interleaved as they come; it ends after each choice's final
    item. A choice's failure raises here; closing the iterator (a client that went away) closes
    every choice's stream, which aborts it on its workers."""
    sample_logprobs = choices.best_of > choices.n
    groups = [
        [
            choice_request(request, index, sample_logprobs, offset * choices.best_of + index)
            for index in range(choices.best_of)
        ]
        for offset, request in enumerate(prompts)
    ]
    if len(groups) == 1 and len(groups[0]) == 1:
        async with contextlib.aclosing(router.generate(groups[0][0])) as stream:
            async for item in stream:
                yield 0, item
        return
    # (index, item), or (index, the exception a choice failed with)
    queue: asyncio.Queue[tuple[int, StreamItem | BaseException]] = asyncio.Queue()
    tasks: list[asyncio.Task] = []

    def start_others(first: int, requests: list[ValidatedRequest], route: Optional[Route]) -> None:
        for index in range(1, len(requests)):
            tasks.append(
                asyncio.create_task(_run(router, requests[index], first + index, queue, route))
            )

    for offset, requests in enumerate(groups):
        first = offset * choices.best_of
        shared = functools.partial(start_others, first, requests)
        tasks.append(asyncio.create_task(_run(router, requests[0], first, queue, None, shared)))
    try:
        finished, total = 0, sum(len(requests) for requests in groups)
        while finished < total:
            index, item = await queue.get()
            if isinstance(item, BaseException):
                raise item
            if item.final is not None:
                finished += 1
            yield index, item
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def _run(
    router: Router,
    request: ValidatedRequest,
    index: int,
    queue: asyncio.Queue,
    pinned_to: Optional[Route],
    shared=None,  # choice 0: called with its route once its KV is on its decode worker
) -> None:
    items = 0
    try:
        async with contextlib.aclosing(router.generate(request, pinned_to)) as stream:
            async for item in stream:
                items += 1
                # the second item is the first decoded chunk: the prompt's KV is installed by then
                if shared is not None and (items == 2 or item.final is not None):
                    shared(router.route_of(request.request_id))
                    shared = None
                queue.put_nowait((index, item))
    except Exception as error:
        queue.put_nowait((index, error))


def cumulative_logprob(items: Sequence[StreamItem]) -> float:
    return sum(entry.logprob for item in items for entry in item.logprobs or ())


def best(generated: Sequence[Sequence[StreamItem]], choices: Choices) -> list[Sequence[StreamItem]]:
    """Of each prompt's `best_of` choices (in index order), the `n` of the highest cumulative
    logprob (vLLM's best_of rule), best first."""
    kept: list[Sequence[StreamItem]] = []
    for first in range(0, len(generated), choices.best_of):
        group = generated[first : first + choices.best_of]
        kept += sorted(group, key=cumulative_logprob, reverse=True)[: choices.n]
    return kept
