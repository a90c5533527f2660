"""The faithful fast decode: piecewise CUDA graphs around an eager attention over the exact
cache length (vLLM's piecewise graphs), on transformers' own Llama modules and its growing
`DynamicCache`. Token-identical to `generate()` because its logits are the dynamic path's, bit
for bit.

Why not one graph: a decode step's attention reads a key length that grows by one each step. A
preallocated cache (`CompiledDecoder`'s) gives it a fixed length with the unwritten positions
masked, which changes the attention's reduction length, and with it the bits (the compiled path
flips near-ties). Everything else in a step has the same shapes at every step (batch x one
token), so the step is cut at each attention:

    piece 0      the embedding, RoPE's cos/sin, layer 0's input norm, q/k/v projections, RoPE
                 (k and v stacked into one tensor, for one copy into the cache)
    attention i  the new k/v written at the next position of layer i's cache, and the attention
                 over the exact cache length (keys[..., :n, :]), eagerly
    piece i      layer i-1's o_proj, residual, post-attention norm, MLP, residual; then layer
                 i's input norm, q/k/v and RoPE
    piece L      layer L-1's rest, the final norm, the native lm_head, its float32 logits and
                 their top-k packed for one device-to-host copy

The cache. Where the model's attention is SDPA and its decode mask is None (no padding: what
`create_causal_mask` gives one query token), the keys and values live in one preallocated
buffer per layer, written in place at the next position, and the attention reads a view of the
first n positions: the values `DynamicCache`'s `torch.cat` would hold, without reallocating the
whole cache every step, and without building the (None) mask every step. The SDPA call is the
one transformers' `sdpa_attention_forward` makes for one query token without a mask (the same
arguments: `enable_gqa` where transformers passes it, `is_causal=False`, the module's scale),
made directly: the step is host-bound, and that function's Python costs as much as the kernel.
Any other attention (eager, or SDPA with a mask) runs transformers' own attention function on
a `DynamicCache`, with the mask `create_causal_mask` builds at each step.

Each piece calls the modules and functions transformers' forward calls (the layer's own norms,
projections and MLP, its modeling module's `apply_rotary_pos_emb`, the configured attention
function), in the same order, on tensors of the same shapes, dtypes and strides, with the same
process-wide flags (deterministic algorithms stay on; only the NaN-filling of fresh buffers is
off during a step, which changes no value). A CUDA graph replays the kernels its
capture launched, with the same arguments; cuBLAS chooses its kernel from the shapes, the
alignment and the workspace size, which `CUBLAS_WORKSPACE_CONFIG` sets alike for the capture
stream and the eager one. So the logits equal the dynamic path's bit for bit; `check` verifies
it on the engine's first decode (a dynamic decode alongside, every step's hidden state and
logits compared with `torch.equal`), and the engine decodes dynamically where it does not hold.
On the CPU, or where capture fails, the same pieces run without graphs.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.utils.deterministic

from replay_audit.engine.decoder import Body, DynamicDecoder, StepOutput, captured_step_output
from replay_audit.engine.numerics import LmHead, pack_top_k, top_k_size

#: The transformers classes whose forward the pieces follow, by class name (Llama's layout:
#: pre-norm attention and MLP with residuals, no sliding window). Other models decode
#: dynamically; `unsupported_reason` says why.
SUPPORTED_MODULES = {
    "layer": ("LlamaDecoderLayer",),
    "attention": ("LlamaAttention",),
    "mlp": ("LlamaMLP",),
    "norm": ("LlamaRMSNorm",),
}
#: RoPE types whose frequencies change with the sequence length on the host (not capturable).
DYNAMIC_ROPE_TYPES = ("dynamic", "longrope")
#: Decode steps `check` compares with the dynamic path.
CHECK_STEPS = 4
#: Positions a buffered cache holds at least beyond its prefill (it doubles when full).
CACHE_HEADROOM = 256


def unsupported_reason(model: Any) -> str | None:
    """Why the piecewise step cannot follow this transformers model's forward, or None."""
    body = getattr(model, "model", None)
    names = ("embed_tokens", "layers", "norm", "rotary_emb")
    if body is None or not all(hasattr(body, n) for n in names):
        return f"{type(model).__name__} has no Llama-style body (model.model.{{{','.join(names)}}})"
    config = body.config
    layers = list(body.layers[: config.num_hidden_layers])
    if not layers:
        return "the model has no decoder layers"
    for layer in layers:
        parts = {
            "layer": layer,
            "attention": getattr(layer, "self_attn", None),
            "mlp": getattr(layer, "mlp", None),
            "norm": getattr(layer, "input_layernorm", None),
        }
        for role, module in parts.items():
            if type(module).__name__ not in SUPPORTED_MODULES[role]:
                return f"{role} {type(module).__name__} is not one the piecewise step follows"
    if type(body.norm).__name__ not in SUPPORTED_MODULES["norm"]:
        return f"final norm {type(body.norm).__name__} is not one the piecewise step follows"
    rope = str(getattr(body.rotary_emb, "rope_type", "default"))
    if any(t in rope for t in DYNAMIC_ROPE_TYPES):
        return f"RoPE type {rope!r} updates its frequencies on the host"
    layer_types = getattr(config, "layer_types", None) or ()
    if getattr(config, "sliding_window", None) or any(t != "full_attention" for t in layer_types):
        return "sliding-window attention layers"
    if str(getattr(config, "_attn_implementation", "eager")).startswith(("flex", "paged")):
        return f"attention {config._attn_implementation!r} builds its mask as a block structure"
    return None


class PiecewiseDecoder:
    """A KV-cache decode whose step runs as `len(layers) + 1` pieces (module docstring): on
    CUDA each piece captured once in a CUDA graph (one memory pool, one side stream), the
    attention between them eager over the exact `DynamicCache`. Its prefill is the dynamic
    path's (`DynamicDecoder`), its steps' logits are the dynamic path's bit for bit.

    One decoder per engine: the graphs hold the body's batch shape and the pieces' buffers,
    never the cache, which is new for each decode. `graphs=False` runs the pieces uncaptured
    (what the CPU does); on a capture failure it does the same and `capture_error` says why.
    """

    def __init__(self, body: Body, head: LmHead, *, graphs: bool | None = None) -> None:
        reason = unsupported_reason(body.model)
        if reason is not None:
            raise ValueError(f"piecewise decode: {reason}")
        self.body = body
        self.head = head
        model = body.model.model
        self.config = model.config
        self.embed = model.embed_tokens
        self.rotary = model.rotary_emb
        self.final_norm = model.norm
        self.layers = list(model.layers[: self.config.num_hidden_layers])
        attn = self.layers[0].self_attn
        modeling = sys.modules[type(attn).__module__]
        # The functions the modeling module itself calls (its own, as transformers resolves
        # them at each forward): RoPE, the mask and the configured attention kernel.
        self._rope: Callable[..., tuple[torch.Tensor, torch.Tensor]] = modeling.apply_rotary_pos_emb
        self._mask: Callable[..., Any] = modeling.create_causal_mask
        self._attention: Callable[..., tuple[torch.Tensor, Any]] = (
            modeling.ALL_ATTENTION_FUNCTIONS.get_interface(
                self.config._attn_implementation, modeling.eager_attention_forward
            )
        )
        #: Whether the attention is transformers' SDPA, which the buffered step calls directly
        #: (module docstring), and the extra SDPA arguments it passes for one query token
        #: without a mask (None: a layout the direct call does not follow).
        self._sdpa_kwargs = _direct_sdpa_kwargs(self._attention, attn)
        b, dev = body.batch_size, body.device
        dtype = self.embed.weight.dtype
        width = attn.o_proj.in_features
        self.token = torch.zeros((1, 1), dtype=torch.long, device=dev)
        self.position = torch.zeros((1, 1), dtype=torch.long, device=dev)
        #: The attention output of each layer, where the next piece reads it (o_proj's input).
        self.attn_out = [torch.zeros((b, 1, width), dtype=dtype, device=dev) for _ in self.layers]
        self.kk = top_k_size(0, head.vocab_size)
        #: Per layer, what its eager attention needs (looked up once: the step is host-bound).
        self._attention_args = [
            (layer.self_attn, layer.self_attn.layer_idx, layer.self_attn.scaling, buffer)
            for layer, buffer in zip(self.layers, self.attn_out, strict=True)
        ]
        # The pieces' live outputs: the residual stream, RoPE's cos/sin, this layer's q/k/v.
        self._h: torch.Tensor = self.attn_out[0]
        self._cos: torch.Tensor = self.attn_out[0]
        self._sin: torch.Tensor = self.attn_out[0]
        #: This layer's query and its new key/value stacked (2, batch, kv heads, 1, head dim).
        self._qkv: tuple[torch.Tensor, torch.Tensor] | None = None
        self._last: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None
        self.graphs: list[Any] = []
        self._graph_outputs: list[tuple[torch.Tensor, ...]] = []
        self.capture_error: str | None = None
        self._want_graphs = dev.type == "cuda" if graphs is None else graphs
        #: "bitwise" once `check` found every compared step equal; otherwise why not (None:
        #: not checked yet).
        self.check_result: str | None = None
        self._dynamic = DynamicDecoder(body, head)
        #: The decode in progress: its `DynamicCache` (unbuffered) or its buffers, one per
        #: layer (2, batch, kv heads, capacity, head dim), the next position, the k asked for.
        self.cache: Any = None
        self.buffers: list[torch.Tensor] = []
        self._position = 0
        self._top_k = 0
        #: Whether the decode in progress keeps its cache in `buffers` (module docstring).
        self.buffered = False

    # -- the Decoder interface ------------------------------------------------------------

    def prefill(self, context: Sequence[int], top_k: int) -> StepOutput:
        """The dynamic path's prefill (a new `DynamicCache`, one forward of the context); then,
        where the steps' attention is SDPA without a mask, its keys and values copied into the
        decoder's buffers (module docstring)."""
        self._top_k = top_k
        out = self._dynamic.prefill(context, top_k)
        self.cache = self._dynamic.cache
        self._position = len(context)
        self.buffered = self._sdpa_kwargs is not None and self._step_mask() is None
        if self.buffered:
            self._fill_buffers()
        return out

    def _step_mask(self) -> Any:
        """The mask of the next step's attention, as the model's forward makes it from the
        cache before the step's update (None for SDPA without padding; an additive mask for
        eager)."""
        b = self.body.batch_size
        self.position.fill_(self._position)
        return self._mask(
            config=self.config,
            inputs_embeds=self.attn_out[0].expand(b, -1, -1),
            attention_mask=None,
            past_key_values=self.cache,
            position_ids=self.position.expand(b, -1),
        )

    def _fill_buffers(self) -> None:
        """Copy the prefill's `DynamicCache` into the buffers (grown to hold it and
        `CACHE_HEADROOM` more positions), and let the `DynamicCache` go."""
        n = self._position
        self._ensure_capacity(n + CACHE_HEADROOM)
        for buf, layer in zip(self.buffers, self.cache.layers, strict=True):
            buf[0, :, :, :n].copy_(layer.keys)
            buf[1, :, :, :n].copy_(layer.values)
        self.cache = None

    def _ensure_capacity(self, n: int) -> None:
        """Buffers of at least `n` positions (doubling; what they hold is kept)."""
        have = self.buffers[0].shape[3] if self.buffers else 0
        if n <= have:
            return
        cap = max(have, CACHE_HEADROOM)
        while cap < n:
            cap *= 2
        attn = self.layers[0].self_attn
        kv_heads = self.config.num_key_value_heads
        shape = (2, self.body.batch_size, kv_heads, cap, attn.head_dim)
        dtype, dev = self.attn_out[0].dtype, self.body.device
        old = self.buffers
        self.buffers = [torch.zeros(shape, dtype=dtype, device=dev) for _ in self.layers]
        for new, buf in zip(self.buffers, old, strict=False):
            new[:, :, :, :have].copy_(buf)

    def step(self, token: int) -> StepOutput:
        """One token at the next position: the pieces (graph replays or eager) with the eager
        attention between them, then one device-to-host copy of the top-k. Without torch's
        deterministic NaN-filling of fresh buffers, as the graphs were captured (`_capture`:
        it changes no value, and the eager attention launches fewer kernels)."""
        if self._want_graphs and not self.graphs and self.capture_error is None:
            self._capture()
        deterministic: Any = torch.utils.deterministic
        fill = deterministic.fill_uninitialized_memory
        deterministic.fill_uninitialized_memory = False
        try:
            return self._step(token)
        finally:
            deterministic.fill_uninitialized_memory = fill

    def _step(self, token: int) -> StepOutput:
        self.token.fill_(token)
        self.position.fill_(self._position)
        if self.buffered:
            self._ensure_capacity(self._position + 1)
            self._run(0)
            self._buffered_attention()
        else:
            self._run(0)
            self._dynamic_attention()
        self._position += 1
        assert self._last is not None
        return captured_step_output(*self._last, self._top_k)

    def _buffered_attention(self) -> None:
        """Each layer's attention between the pieces, on the buffers: the new key/value
        written at the next position, SDPA over the first n positions (as transformers'
        `sdpa_attention_forward` calls it for one query token without a mask)."""
        n = self._position + 1
        sdpa = torch.nn.functional.scaled_dot_product_attention
        kwargs = self._sdpa_kwargs or {}
        for i, ((_, _, scaling, out_buffer), kv) in enumerate(
            zip(self._attention_args, self.buffers, strict=True)
        ):
            assert self._qkv is not None
            q, new = self._qkv
            kv[:, :, :, n - 1 : n].copy_(new)
            view = kv[:, :, :, :n]
            out = sdpa(
                q,
                view[0],
                view[1],
                attn_mask=None,
                dropout_p=0.0,
                scale=scaling,
                is_causal=False,
                **kwargs,
            )
            # transformers' (batch, heads, 1, dim) -> transpose(1, 2).contiguous() -> reshape
            # (batch, 1, heads * dim): for one query token, the same element order.
            out_buffer.copy_(out.reshape(out_buffer.shape))
            self._run(i + 1)

    def _dynamic_attention(self) -> None:
        """Each layer's attention between the pieces on the `DynamicCache`: its update
        (torch.cat) and transformers' attention function with the step's mask."""
        positions = self.position.expand(self.body.batch_size, -1)
        cache = self.cache
        mask = self._mask(
            config=self.config,
            inputs_embeds=self._h,
            attention_mask=None,
            past_key_values=cache,
            position_ids=positions,
        )
        for i, (attn, layer_idx, scaling, buffer) in enumerate(self._attention_args):
            assert self._qkv is not None
            q, kv = self._qkv
            keys, values = cache.update(kv[0], kv[1], layer_idx)
            out, _ = self._attention(
                attn,
                q,
                keys,
                values,
                mask,
                dropout=0.0,
                scaling=scaling,
                position_ids=positions,
                use_cache=True,
            )
            buffer.copy_(out.reshape(buffer.shape))
            self._run(i + 1)

    # -- the check ------------------------------------------------------------------------

    def check(self, context: Sequence[int], steps: int = CHECK_STEPS) -> bool:
        """Decode `steps` greedy steps from `context` with this decoder and with a dynamic one,
        and compare every step's hidden state and float32 logits bitwise; `check_result` says
        "bitwise" or where they first differ. The caches are the decoders' own."""
        reference = DynamicDecoder(self.body, self.head)
        a, b = self.prefill(context, 2), reference.prefill(context, 2)
        for t in range(steps):
            token = int(b.top.native[0])
            a, b = self.step(token), reference.step(token)
            if not (torch.equal(a.logits, b.logits) and torch.equal(a.hidden, b.hidden)):
                diff = (a.logits - b.logits).abs().max().item()
                self.check_result = (
                    f"step {t + 1} differs from the dynamic path (max |logit diff| {diff:.3g})"
                )
                return False
        self.check_result = "bitwise"
        return True

    # -- the pieces -----------------------------------------------------------------------

    def _project(
        self, i: int, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Layer i's input norm, q/k/v projections and RoPE of its input `h`, as
        `LlamaAttention.forward`; the query, and the key and value stacked (a copy: the same
        values) for one write into the cache."""
        layer = self.layers[i]
        attn = layer.self_attn
        x = layer.input_layernorm(h)
        hidden_shape = (*x.shape[:-1], -1, attn.head_dim)
        q = attn.q_proj(x).view(hidden_shape).transpose(1, 2)
        k = attn.k_proj(x).view(hidden_shape).transpose(1, 2)
        v = attn.v_proj(x).view(hidden_shape).transpose(1, 2)
        q, k = self._rope(q, k, cos, sin)
        return q, torch.stack((k, v))

    def _finish_layer(self, i: int, residual: torch.Tensor) -> torch.Tensor:
        """The rest of layer i (input `residual`) after its attention, as
        `LlamaDecoderLayer.forward`."""
        layer = self.layers[i]
        hidden = layer.self_attn.o_proj(self.attn_out[i])
        hidden = residual + hidden
        residual = hidden
        hidden = layer.post_attention_layernorm(hidden)
        hidden = layer.mlp(hidden)
        out: torch.Tensor = residual + hidden
        return out

    def _piece(self, i: int) -> tuple[torch.Tensor, ...]:
        """Piece i (module docstring), from the live outputs of piece i-1 (or the token and
        position buffers); changes no state."""
        b = self.body.batch_size
        if i == 0:
            # As `Body.forward`: the token and its position expanded over the batch copies.
            h = self.embed(self.token.expand(b, -1))
            cos, sin = self.rotary(h, position_ids=self.position.expand(b, -1))
            return (h, cos, sin, *self._project(0, h, cos, sin))
        h = self._finish_layer(i - 1, self._h)
        if i < len(self.layers):
            return (h, *self._project(i, h, self._cos, self._sin))
        last = self.final_norm(h)[:, -1]
        z32 = self.head.native(last)[0].float()
        return last, z32, pack_top_k(z32, self.kk)

    def _take(self, i: int, outputs: tuple[torch.Tensor, ...]) -> None:
        """Make piece i's outputs the live ones (after a replay: the graph's static outputs)."""
        if i == 0:
            self._h, self._cos, self._sin, q, kv = outputs
            self._qkv = (q, kv)
        elif i < len(self.layers):
            self._h, q, kv = outputs
            self._qkv = (q, kv)
        else:
            last, z32, packed = outputs
            self._last = (last, z32, packed)

    def _run(self, i: int) -> None:
        if self.graphs:
            self.graphs[i].replay()
            self._take(i, self._graph_outputs[i])
        else:
            self._take(i, self._piece(i))

    def _capture(self) -> None:
        """Capture every piece in its own CUDA graph, in step order, on one side stream and
        one memory pool (the graphs replay in that order, never concurrently). Each piece is
        run once uncaptured on the same stream first (cuBLAS's handle and workspace for that
        stream, lazy initialisations). Its inputs are the previous piece's static outputs
        and the attention buffers; the values they hold during capture do not matter: no
        piece touches the cache.

        Captured without torch's deterministic filling of uninitialised memory (which, with
        deterministic algorithms on, writes NaN into every buffer an op allocates through
        `empty` before the op overwrites all of it: a few hundred tiny kernels per step that
        change no value). Everything else, deterministic algorithms included, is as eager;
        `check` compares the result with the dynamic path, which fills."""
        deterministic: Any = torch.utils.deterministic
        fill = deterministic.fill_uninitialized_memory
        deterministic.fill_uninitialized_memory = False
        try:
            with torch.cuda.device(self.body.device):
                self.graphs, self._graph_outputs = self._capture_on_device()
        except Exception as exc:
            # An op that cannot be captured (a host sync), or anything else: run uncaptured.
            self.graphs, self._graph_outputs = [], []
            self.capture_error = f"{type(exc).__name__}: {exc}"[:300]
            if torch.cuda.is_available():
                with contextlib.suppress(Exception):
                    torch.cuda.synchronize()
        finally:
            deterministic.fill_uninitialized_memory = fill

    def _capture_on_device(self) -> tuple[list[Any], list[tuple[torch.Tensor, ...]]]:
        stream_cls: Any = torch.cuda.Stream
        side = stream_cls()
        side.wait_stream(torch.cuda.current_stream())
        pool = torch.cuda.graph_pool_handle()
        graphs: list[Any] = []
        outputs: list[tuple[torch.Tensor, ...]] = []
        for i in range(len(self.layers) + 1):
            with torch.cuda.stream(side):
                self._piece(i)  # warm-up, uncaptured
            side.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool, stream=side):
                out = self._piece(i)
            self._take(i, out)
            graphs.append(graph)
            outputs.append(out)
        torch.cuda.current_stream().wait_stream(side)
        return graphs, outputs


def _direct_sdpa_kwargs(attention: Callable[..., Any], attn: Any) -> dict[str, bool] | None:
    """The keyword arguments transformers' `sdpa_attention_forward` adds to its SDPA call for
    one query token without a mask on this attention module (`enable_gqa` where it passes it),
    or None where `attention` is not that function or takes another route (it repeats or packs
    the key/value heads), which the buffered step does not follow."""
    if getattr(attention, "__name__", "") != "sdpa_attention_forward":
        return None
    module = sys.modules.get(getattr(attention, "__module__", ""))
    groups = int(getattr(attn, "num_key_value_groups", 1))
    if groups <= 1:
        return {}
    use_gqa = getattr(module, "use_gqa_in_sdpa", None)
    if use_gqa is None:
        return None
    probe = torch.zeros((1, 1, 1, attn.head_dim))
    return {"enable_gqa": True} if use_gqa(None, probe, probe) else None
