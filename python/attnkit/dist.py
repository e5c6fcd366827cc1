"""attnkit.dist: attention split across processes with MPI (mpi4py).

Every function and method here is collective over its communicator: every
rank calls it, in the same order. A bad argument on one rank raises
ValueError on every rank, with that rank's message and "(on rank r of N)",
and a failed call changes no rank's cache or weights. Communicators are
mpi4py intracommunicators (mpi4py.MPI.COMM_WORLD, or one from Split).
docs/DISTRIBUTED.md explains the strategies and what they cost.

    from mpi4py import MPI
    import attnkit.dist

    layer = attnkit.dist.HeadParallelAttention(MPI.COMM_WORLD, config, state_dict,
                                               prefix="model.layers.0.self_attn.")
    cache = layer.new_cache(batch_size=1, max_seq_len=4096)
    y = layer.forward(prompt, cache=cache)       # every rank gets the whole output
    y = layer.forward(next_token, cache=cache)

Run under mpirun (as root, Open MPI also wants --allow-run-as-root):

    mpirun -np 4 /usr/bin/python3 script.py
"""
import json

from mpi4py import MPI  # initialises MPI, and loads it for _attnkit_dist to share

from . import MLA_MODEL_TYPES, _config_dict

try:
    from . import _attnkit_dist as _native
except ImportError as e:  # pragma: no cover - depends on the build
    raise ImportError("attnkit.dist: this build of attnkit has no MPI support (CMake found no "
                      "MPI; install libopenmpi-dev and rebuild)") from e

__all__ = ["HeadParallelAttention", "context_parallel_decode", "merge_partial_attention",
           "ring_attention", "ring_chunks", "head_share"]


def _handle(comm, fn):
    """The communicator's Fortran handle for the native module. A bad comm
    cannot be agreed on (there is no communicator to agree over), so this
    error is raised on the ranks that passed it only."""
    if not isinstance(comm, MPI.Intracomm) or comm == MPI.COMM_NULL:
        raise ValueError(f"{fn}: comm must be an mpi4py intracommunicator (such as "
                         f"MPI.COMM_WORLD), got {comm!r}")
    return comm.py2f()


def _on_every_rank(comm_f, thunk):
    """thunk(), whose ValueError/TypeError/OSError on any rank is raised as
    ValueError on every rank (so that no rank waits in a later collective)."""
    result, error = None, None
    try:
        result = thunk()
    except (ValueError, TypeError, OSError) as e:
        error = str(e)
    _native.agree(comm_f, error)
    return result


class HeadParallelAttention:
    """An attention layer of a Hugging Face config, split by heads over the
    ranks of `comm` (Megatron-style tensor parallelism).

        HeadParallelAttention(comm, hf_config, state_dict, prefix="", layer_index=0)

    hf_config: a config.json as a dict (or a transformers config, or a
        path), as attnkit.from_config takes. MHA/MQA/GQA (llama, mistral,
        qwen2, qwen3, gemma2, ...) or MLA (deepseek_v2, deepseek_v3, kimi_k2).
    state_dict: the whole layer's weights, Hugging Face names under
        `prefix`, on every rank; each rank keeps its own shard.

    MHA/MQA/GQA: rank r owns a contiguous share of the kv heads and their
    query heads (attnkit.dist.head_share), the matching rows of q/k/v_proj
    and columns of o_proj, and a KV cache of its kv heads only. With fewer
    kv heads than ranks the kv heads are replicated (as vLLM does) and their
    query heads split. MLA: the query heads are split; every rank keeps the
    whole latent cache. num_heads must be >= the number of ranks; shares
    may be uneven. forward() sums the ranks' o_proj outputs with one
    all-reduce, so every rank gets the whole output.
    """

    def __init__(self, comm, hf_config, state_dict, prefix="", layer_index=0):
        fn = "HeadParallelAttention"
        comm_f = _handle(comm, fn)
        self._comm = comm  # keeps the communicator alive as long as the layer
        config = _on_every_rank(comm_f, lambda: _config_dict(hf_config, fn))
        text = json.dumps(config)
        self.is_mla = config.get("model_type") in MLA_MODEL_TYPES
        if self.is_mla:
            self._layer = _native.HeadParallelLatentAttention(comm_f, text)
        else:
            self._layer = _native.HeadParallelAttention(comm_f, text, layer_index)
        self._layer.load_state_dict(state_dict, prefix)

    @property
    def rank(self):
        return self._layer.rank

    @property
    def world_size(self):
        return self._layer.world_size

    @property
    def share(self):
        """This rank's heads: {"q_heads": (begin, end), "kv_heads": (begin, end)}."""
        return self._layer.share

    def new_cache(self, batch_size, max_seq_len, dtype="float32"):
        """This rank's cache ('float32' or 'bfloat16'): its kv heads' K/V, or
        for MLA the whole latent cache."""
        return self._layer.new_cache(batch_size, max_seq_len, dtype)

    def forward(self, x, positions=None, cache=None, *, form="auto", backend="auto",
                num_threads=0):
        """Self-attention of x [batch, seq, hidden] (the same on every rank)
        -> float32 [batch, seq, hidden] on every rank. positions and cache as
        the layers of attnkit.from_config take them; form ('auto', 'naive',
        'absorbed') for MLA only."""
        if self.is_mla:
            return self._layer.forward(x, positions, cache, form, backend, num_threads)
        return self._layer.forward(x, positions, cache, backend, num_threads)

    __call__ = forward


def context_parallel_decode(comm, q, k_local, v_local, softmax_scale=None, softcap=0.0,
                            return_lse=False, *, seqlens_k=None, merge="allgather",
                            backend="auto", num_threads=0):
    """Attention of q over keys split across the ranks by tokens.

        q        [batch, seqlen_q, num_heads, head_dim]         the same on every rank
        k_local  [batch, seqlen_k_r, num_kv_heads, head_dim]    this rank's keys
        v_local  [batch, seqlen_k_r, num_kv_heads, head_dim_v]  this rank's values
        -> out [batch, seqlen_q, num_heads, head_dim_v] float32 on every rank
           (with return_lse: (out, lse [batch, num_heads, seqlen_q]))

    Any split works (contiguous, round-robin, none on some ranks:
    seqlen_k_r may be 0); every query sees every key (decode: the new
    tokens are the newest). Each rank attends its keys and the partial
    results merge by log-sum-exp in one collective: merge="allgather" (every
    partial to every rank, merged in rank order) or "allreduce" (an
    MPI_Allreduce with a merge operation; see MergeMethod in
    attnkit/dist.h for what each sends). seqlens_k: this
    rank's valid keys per sequence, for a ragged batch.
    """
    comm_f = _handle(comm, "context_parallel_decode")
    return _native.context_parallel_decode(comm_f, q, k_local, v_local, softmax_scale, softcap,
                                           return_lse, seqlens_k, merge, backend, num_threads)


def merge_partial_attention(comm, out_local, lse_local, return_lse=False, *,
                            merge="allgather"):
    """Combines the ranks' partial attentions over disjoint key sets into
    the attention over all their keys, on every rank.

        out_local  [batch, seqlen_q, num_heads, head_dim_v]  this rank's partial output
        lse_local  [batch, num_heads, seqlen_q]              its log-sum-exp (-inf: no keys)
        -> out [batch, seqlen_q, num_heads, head_dim_v] float32
           (with return_lse: (out, lse [batch, num_heads, seqlen_q]))

    Shapes must match across ranks. Any kernel that returns (out, lse) can
    be merged: PagedKVCache.attend_held gives a paged pool's share (its
    out [total_q, H, Dv] and lse [H, total_q] are out[None] and lse[None]
    here), which is context-parallel decode over paged pools. merge as in
    context_parallel_decode.
    """
    comm_f = _handle(comm, "merge_partial_attention")
    return _native.merge_partial_attention(comm_f, out_local, lse_local, return_lse, merge)


def ring_attention(comm, q_local, k_local, v_local, causal=True, *, softmax_scale=None,
                   softcap=0.0, return_lse=False, backend="auto", num_threads=0):
    """Self-attention over a sequence split across the ranks for ring
    attention, load-balanced for the causal mask.

    Layout: the S tokens are cut into 2N chunks (N ranks), chunk c holding
    tokens [c S // 2N, (c+1) S // 2N), and rank r holds chunk r followed by
    chunk 2N-1-r (ring_chunks(S, N, r) gives both ranges). For N = 2, S = 8:

        tokens  0 1 | 2 3 | 4 5 | 6 7
        rank    0   | 1   | 1   | 0      rank 0: 0 1 6 7    rank 1: 2 3 4 5

        q_local  [batch, n_r, num_heads, head_dim]      this rank's tokens, in that order
        k_local  [batch, n_r, num_kv_heads, head_dim]
        v_local  [batch, n_r, num_kv_heads, head_dim_v]
        -> out_local [batch, n_r, num_heads, head_dim_v] float32
           (with return_lse: (out_local, lse_local [batch, num_heads, n_r]))

    The K/V blocks go around the ring, the next one received while the
    current one is attended. With causal=True token i sees tokens <= i.
    """
    comm_f = _handle(comm, "ring_attention")
    return _native.ring_attention(comm_f, q_local, k_local, v_local, causal, softmax_scale,
                                  softcap, return_lse, backend, num_threads)


def ring_chunks(seqlen, world_size, rank):
    """((begin, end), (begin, end)): the two token ranges rank `rank` holds
    in ring_attention's layout."""
    return _native.ring_chunks(seqlen, world_size, rank)


def head_share(num_heads, num_kv_heads, world_size, rank):
    """{"q_heads": (begin, end), "kv_heads": (begin, end)}: the heads rank
    `rank` owns in HeadParallelAttention (MLA: num_kv_heads = num_heads)."""
    return _native.head_share(num_heads, num_kv_heads, world_size, rank)
