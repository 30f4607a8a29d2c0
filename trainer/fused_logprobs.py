"""Per-token log-probabilities and entropy from vocabulary-parallel logits without fp32 copies of the logits.

The plain formula (``logits.float()``, shift, ``exp``, sums; autograd keeps the fp32 intermediates) holds
several fp32 tensors the size of the logits: at 8192 tokens and a 151,936-token vocabulary each is 5 GB.
Here an autograd function walks the logits in row chunks: the forward converts one chunk to fp32 at a
time and keeps only per-token statistics (log-partition, entropy); the backward recomputes the softmax of
each chunk from the saved logits (in their own dtype, usually bf16, which autograd would keep anyway) and
writes the gradient straight into the logits' dtype. Arithmetic is fp32 throughout, as in the plain formula.

Tensor parallelism (vocabulary sharded over TP ranks): each rank reduces its shard with its own maximum;
the maxima, the rescaled sums and the label's logit are combined over the TP group in the forward. The
backward needs no communication: every rank's gradient is its own shard's columns.

With ``z`` the (temperature-scaled) logits of a token, ``lse = log sum exp z``, ``p = softmax z``:
``logprob = z[label] - lse``, ``entropy = lse - sum p z``;
``d logprob / dz = onehot(label) - p``, ``d entropy / dz = -p (z - lse + entropy)``.
"""

from __future__ import annotations

import torch
import torch.distributed as dist


def _all_reduce(t: torch.Tensor, op, group) -> torch.Tensor:
    if group is not None and dist.get_world_size(group) > 1:
        dist.all_reduce(t, op=op, group=group)
    return t


def _log_softmax(chunk: torch.Tensor, scale: float) -> torch.Tensor:
    """fp32 log-softmax of a row chunk: one kernel reading the logits' own dtype when unscaled."""
    if scale == 1.0:
        return torch.log_softmax(chunk, dim=-1, dtype=torch.float32)
    return torch.log_softmax(torch.mul(chunk.to(torch.float32), scale), dim=-1)  # out of place: fp32 input


class _ChunkedLogSoftmax(torch.autograd.Function):
    """The whole vocabulary on this rank: log-softmax per row chunk (forward one kernel per chunk)."""

    @staticmethod
    def forward(ctx, logits, labels, with_entropy, scale, chunk):
        tokens = logits.shape[0]
        local = labels.long()
        logprobs = torch.empty(tokens, dtype=torch.float32, device=logits.device)
        entropy = torch.empty_like(logprobs) if with_entropy else None
        for start in range(0, tokens, chunk):
            rows = slice(start, min(start + chunk, tokens))
            logp = _log_softmax(logits[rows], scale)
            logprobs[rows] = logp.gather(-1, local[rows, None]).squeeze(-1)
            if with_entropy:
                entropy[rows] = logp.exp().mul_(logp).sum(dim=-1).neg_()
            del logp
        ctx.save_for_backward(logits, local, entropy if with_entropy else logprobs)
        ctx.with_entropy, ctx.scale, ctx.chunk = with_entropy, scale, chunk
        if with_entropy:
            return logprobs, entropy
        return logprobs, torch.zeros(0, device=logits.device)

    @staticmethod
    def backward(ctx, grad_logprobs, grad_entropy):
        logits, local, entropy = ctx.saved_tensors
        tokens = logits.shape[0]
        use_entropy = ctx.with_entropy and grad_entropy is not None
        grad_lp = grad_logprobs if grad_logprobs is not None else torch.zeros_like(entropy)
        grad = torch.empty_like(logits)
        for start in range(0, tokens, ctx.chunk):
            rows = slice(start, min(start + ctx.chunk, tokens))
            logp = _log_softmax(logits[rows], ctx.scale)
            p = logp.exp()
            if use_entropy:
                # -p (g_lp + g_H (log p + H))
                logp.add_(entropy[rows, None]).mul_(grad_entropy[rows, None]).add_(grad_lp[rows, None])
                g = p.mul_(logp).neg_()
            else:
                g = p.mul_(grad_lp[rows, None].neg())
            g.scatter_add_(-1, local[rows, None], grad_lp[rows, None].to(g.dtype))
            if ctx.scale != 1.0:
                g.mul_(ctx.scale)
            grad[rows] = g
            del logp, p, g
        return grad, None, None, None, None


def _shard_stats(logits: torch.Tensor, scale: float, with_entropy: bool):
    """Per row of ``logits``: ``m = max z``, ``s = sum e^(z-m)``, ``w = sum e^(z-m) (z-m)`` (``z`` = scaled
    fp32 logits). Under torch.compile one kernel that reads the logits in their own dtype."""
    z = logits.float() * scale
    m = z.amax(dim=-1, keepdim=True)
    shifted = z - m
    e = shifted.exp()
    w = (e * shifted).sum(dim=-1) if with_entropy else None
    return m.squeeze(-1), e.sum(dim=-1), w


def _shard_grad(
    out, logits, local, log_z, coeff, hit, entropy, grad_entropy, scale: float, use_entropy: bool
):
    """The logits' gradient of one row chunk written into ``out`` (its rows of the whole gradient), in the
    logits' dtype (see the module docstring for the formula); the same operations in the same order as the
    eager backward, one kernel under torch.compile that stores straight into ``out`` (returning the chunk
    and copying it cost a 9 ms pass over the gradient per step at 32k tokens x 151,936 on the H200)."""
    logp = logits.float() * scale - log_z[:, None]
    p = logp.exp()
    if use_entropy:
        g = -(p * ((logp + entropy[:, None]) * grad_entropy[:, None] + coeff[:, None]))
    else:
        g = -(p * coeff[:, None])
    columns = torch.arange(logits.shape[-1], device=logits.device)
    g = g + torch.where(columns[None, :] == local[:, None], hit[:, None], 0.0)
    out.copy_((g * scale).to(logits.dtype))


def _compiled_chunk_fns():
    from tidal.trainer.pointwise import compiled

    return compiled(_shard_stats), compiled(_shard_grad)


class _ChunkedVocabLogprobs(torch.autograd.Function):
    """A vocabulary sharded over a tensor-parallel group: per-shard statistics combined over the group.

    With ``compiled`` each chunk's statistics and gradient are one torch.compile'd kernel each (also used
    for the whole vocabulary on one rank: the group is then None)."""

    @staticmethod
    def forward(ctx, logits, labels, with_entropy, scale, chunk, group, vocab_start, compiled=False):
        tokens, shard = logits.shape
        local = labels.long() - vocab_start
        in_shard = (local >= 0) & (local < shard)
        local = local.clamp(0, shard - 1)
        maxes = torch.empty(tokens, dtype=torch.float32, device=logits.device)
        sums = torch.empty_like(maxes)
        weighted = torch.empty_like(maxes) if with_entropy else None  # sum e^(z-m) (z-m)
        stats = _compiled_chunk_fns()[0] if compiled else None
        for start in range(0, tokens, chunk):
            rows = slice(start, min(start + chunk, tokens))
            if stats is not None:
                maxes[rows], sums[rows], w = stats(logits[rows], scale, with_entropy)
                if with_entropy:
                    weighted[rows] = w
                continue
            z = logits[rows].to(torch.float32, copy=True)  # never a view: changed in place
            if scale != 1.0:
                z.mul_(scale)
            m = z.amax(dim=-1)
            z.sub_(m[:, None])
            e = z.exp()
            maxes[rows] = m
            sums[rows] = e.sum(dim=-1)
            if with_entropy:
                weighted[rows] = (e * z).sum(dim=-1)
            del z, e
        picked = logits.gather(-1, local[:, None]).squeeze(-1).float() * scale
        picked = torch.where(in_shard, picked, torch.zeros_like(picked))
        if group is not None and dist.get_world_size(group) > 1:
            peak = _all_reduce(maxes.clone(), dist.ReduceOp.MAX, group)
            rescale = torch.exp(maxes - peak)
            if with_entropy:
                # sum e^(z-M) (z-M) = e^(m-M) [sum e^(z-m) (z-m) + (m-M) sum e^(z-m)]
                weighted = _all_reduce(rescale * (weighted + (maxes - peak) * sums), dist.ReduceOp.SUM, group)
            sums = _all_reduce(sums * rescale, dist.ReduceOp.SUM, group)
            picked = _all_reduce(picked, dist.ReduceOp.SUM, group)
            maxes = peak
        log_z = maxes + sums.log()
        logprobs = picked - log_z
        entropy = sums.log() - weighted / sums if with_entropy else None
        ctx.save_for_backward(logits, local, in_shard, log_z, entropy if with_entropy else log_z)
        ctx.with_entropy, ctx.scale, ctx.chunk, ctx.compiled = with_entropy, scale, chunk, compiled
        if with_entropy:
            return logprobs, entropy
        return logprobs, torch.zeros(0, device=logits.device)

    @staticmethod
    def backward(ctx, grad_logprobs, grad_entropy):
        logits, local, in_shard, log_z, entropy = ctx.saved_tensors
        tokens = logits.shape[0]
        use_entropy = ctx.with_entropy and grad_entropy is not None
        grad_lp = grad_logprobs if grad_logprobs is not None else torch.zeros_like(log_z)
        grad = torch.empty_like(logits)
        chunk_grad = _compiled_chunk_fns()[1] if ctx.compiled else None
        for start in range(0, tokens, ctx.chunk):
            rows = slice(start, min(start + ctx.chunk, tokens))
            if chunk_grad is not None:
                chunk_grad(
                    grad[rows],
                    logits[rows],
                    local[rows],
                    log_z[rows],
                    grad_lp[rows],
                    grad_lp[rows] * in_shard[rows],
                    entropy[rows] if use_entropy else None,
                    grad_entropy[rows] if use_entropy else None,
                    ctx.scale,
                    use_entropy,
                )
                continue
            if ctx.scale != 1.0:
                z = torch.mul(logits[rows].to(torch.float32), ctx.scale).sub_(log_z[rows, None])  # log p
            else:
                z = torch.sub(logits[rows], log_z[rows, None])  # log p, fp32 (type promotion), one kernel
            p = z.exp()
            coeff = grad_lp[rows, None]
            if use_entropy:
                # -p (g_lp + g_H (log p + H))
                z.add_(entropy[rows, None]).mul_(grad_entropy[rows, None]).add_(coeff)
                g = p.mul_(z).neg_()
            else:
                g = p.mul_(coeff).neg_()
            hit = (grad_lp[rows] * in_shard[rows]).to(g.dtype)
            g.scatter_add_(-1, local[rows, None], hit[:, None])
            if ctx.scale != 1.0:
                g.mul_(ctx.scale)
            grad[rows] = g
            del z, p, g
        return grad, None, None, None, None, None, None, None


COMPILE_MIN_CHUNK_LOGITS = 1 << 22  # auto: compiled on CUDA from ~4M logits per chunk


def vocab_parallel_logprobs(
    logits: torch.Tensor,
    labels: torch.Tensor,
    *,
    with_entropy: bool = False,
    temperature: float = 1.0,
    chunk_tokens: int = 1024,
    group=None,
    vocab_start: int = 0,
    impl: str = "fused",
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(logprobs ``[T]``, entropy ``[T]`` or None), fp32, of ``softmax(logits / temperature)``.

    ``logits``: ``[T, V_shard]`` in any float dtype, this rank's vocabulary columns starting at
    ``vocab_start``; ``group``: the tensor-parallel group over which the vocabulary is sharded (None: whole);
    ``impl``: ``fused`` (eager chunks), ``compiled`` (each chunk one torch.compile'd kernel) or ``auto``
    (compiled on CUDA when a chunk holds at least :data:`COMPILE_MIN_CHUNK_LOGITS` logits).
    """
    if impl not in ("auto", "compiled", "fused"):
        raise ValueError(f"impl={impl!r} must be auto, compiled or fused")
    if logits.dim() != 2 or labels.shape != logits.shape[:1]:
        raise ValueError(
            f"logits must be [T, V] and labels [T]; got {tuple(logits.shape)} and {tuple(labels.shape)}"
        )
    if temperature <= 0:
        raise ValueError(f"temperature={temperature} must be > 0")
    if chunk_tokens < 1:
        raise ValueError(f"chunk_tokens={chunk_tokens} must be >= 1")
    compiled = impl == "compiled" or (
        impl == "auto"
        and logits.is_cuda
        and min(chunk_tokens, logits.shape[0]) * logits.shape[1] >= COMPILE_MIN_CHUNK_LOGITS
    )
    whole = group is None or dist.get_world_size(group) == 1
    if whole and vocab_start:
        raise ValueError(
            f"vocab_start={vocab_start} without a tensor-parallel group: the shard is the vocabulary"
        )
    if compiled:
        logprobs, entropy = _ChunkedVocabLogprobs.apply(
            logits,
            labels,
            with_entropy,
            1.0 / temperature,
            chunk_tokens,
            None if whole else group,
            vocab_start,
            True,
        )
    elif whole:
        logprobs, entropy = _ChunkedLogSoftmax.apply(
            logits, labels, with_entropy, 1.0 / temperature, chunk_tokens
        )
    else:
        logprobs, entropy = _ChunkedVocabLogprobs.apply(
            logits, labels, with_entropy, 1.0 / temperature, chunk_tokens, group, vocab_start
        )
    return logprobs, entropy if with_entropy else None
