"""How the batch core uses the prefix cache for one request: start it on the longest
cached prefix of its tokens, undo that when it does not fit after all, and index its
computed pages so that later requests reuse them."""

from __future__ import annotations

from ..kv.prefix_cache import Key, PrefixCache
from .request import Request


def shares_kv(req: Request) -> bool:
    """KV computed from token ids alone can be shared; a request whose stage builder
    supplies input embeddings, or whose positions take conditioning rows, computes KV
    that its token ids do not determine."""
    if req.conditioning is not None:
        return False  # its inputs add rows from outside; its ids are placeholders
    data = req.data
    return data is None or (
        getattr(data, "input_embeds", None) is None and getattr(data, "decode_input_embeds", None) is None
    )


def reuse_prefix(kv: PrefixCache, req: Request, computing: set[Key]) -> bool:
    """Start a request that holds no KV on the longest cached prefix of its tokens
    (leaving at least one token to compute, for the logits). False, holding nothing,
    when the page after that prefix is one this step already computes for another
    row (``computing``): next step it is cached and this request reuses it."""
    if not kv.enabled or not shares_kv(req):
        return True
    if req.sampling.return_prompt_hidden_states or req.sampling.prompt_logprobs is not None:
        # Every prompt position is computed (its hidden states or log-probabilities were
        # asked for); the pages it computes are still shared with later requests.
        req.prefix_epoch = kv.epoch
        return True
    fill = req.fill_ids()
    pages = kv.match(fill, len(fill) - 1)
    if computing and kv.first_unmatched_key(fill, pages) in computing:
        kv.release(pages)
        return False
    req.pages = pages
    req.num_cached = len(pages) * kv.page_size
    req.prefix_pages = len(pages)
    req.prefix_epoch = kv.epoch
    kv.count_lookup(len(fill), req.num_cached)
    if req.num_retractions == 0 and req.step_failures == 0:
        req.cached_tokens = req.num_cached
    return True


def drop_prefix(kv: PrefixCache, req: Request) -> None:
    """Undo :func:`reuse_prefix` for a request that does not fit after all."""
    if req.prefix_epoch == kv.epoch:
        kv.count_lookup(len(req.fill_ids()), req.num_cached, times=-1)
    pages, req.pages = req.pages, []
    kv.release(pages)
    req.num_cached = 0
    req.prefix_pages = 0


def computing_key(kv: PrefixCache, req: Request) -> Key | None:
    """The index key of the first page this request computes next."""
    return kv.first_unmatched_key(req.fill_ids(), req.pages[: req.prefix_pages])


def index_pages(kv: PrefixCache, req: Request) -> None:
    """Share the request's full pages whose KV is computed, or being computed by a step
    already launched (every later step follows it on the device). Only in the cache
    epoch the request was admitted in: KV of older weights is never shared."""
    if req.prefix_epoch == kv.epoch:
        fill = req.fill_ids()
        req.prefix_pages = kv.insert(fill, req.pages, req.prefix_pages, min(req.num_cached, len(fill)))
