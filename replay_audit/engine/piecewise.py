"""The faithful fast decode: piecewise CUDA graphs around an eager attention over the exact
cache (vLLM's piecewise graphs), on transformers' own Llama modules, continuing the cache of
transformers' own `generate()` prefill. Token-identical to `generate()` because every kernel it
launches is one `generate()` launches, with the same arguments.

Why not one graph, how the attention call is learned and what `check` compares:
docs/engine.md "The piecewise decode". A preallocated cache changes the attention's reduction
length, so the step is cut at each attention:

    piece 0      the embedding, RoPE's cos/sin, layer 0's input norm, q/k/v projections, RoPE
                 (k and v stacked into one tensor)
    attention i  the new k/v appended to layer i's cache (`torch.cat`, as `DynamicCache`
                 grows it), and the attention over it, eagerly
    piece i      layer i-1's o_proj, residual, post-attention norm, MLP, residual; then layer
                 i's input norm, q/k/v and RoPE
    piece L      layer L-1's rest, the final norm, the native lm_head over the last position,
                 its float32 logits and their top-k packed for one device-to-host copy

No process-wide switch is set (the arm's are, `loading.ProcessNumerics`); only torch's
NaN-filling of fresh buffers is off during a step, which changes no value. On the CPU, or where
capture fails, the same pieces run without graphs.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.utils.deterministic

from replay_audit.engine import attention
from replay_audit.engine.decoder import (
    Body,
    Choose,
    GenerateDecoder,
    StepOutput,
    cache_keyword,
    captured_step_output,
)
from replay_audit.engine.numerics import LmHead, pack_top_k, top_k_size
from replay_audit.engine.protocol import BatchLayout

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
#: Decode steps `check` compares with `generate()`.
CHECK_STEPS = 4


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
    """A KV-cache decode whose step runs as `len(layers) + 1` pieces (module docstring); its
    steps' logits are `generate()`'s bit for bit once `check` passed.

    One decoder per engine: the graphs hold the body's batch shape and the pieces' buffers,
    never the cache, which is new for each decode. `graphs=False` runs the pieces uncaptured.
    """

    def __init__(
        self, body: Body, head: LmHead, reference: GenerateDecoder, *, graphs: bool | None = None
    ) -> None:
        reason = unsupported_reason(body.model)
        if reason is not None:
            raise ValueError(f"piecewise decode: {reason}")
        self.body = body
        self.head = head
        self.reference = reference
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
        #: SDPA's options as `generate()`'s decode steps pass them, learned by `check` (None:
        #: the steps run transformers' attention function on the `DynamicCache`).
        self.direct: attention.SdpaOptions | None = None
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
        #: The decode in progress: `generate()`'s `DynamicCache` (transformers' attention) or
        #: each layer's keys and values taken from it (the direct call), the next position,
        #: the k asked for.
        self.cache: Any = None
        self.kv: list[list[torch.Tensor]] = []
        self._position = 0
        self._top_k = 0

    # -- the Decoder interface ------------------------------------------------------------

    def run(
        self,
        context: Sequence[int],
        max_new_tokens: int,
        choose: Choose,
        top_k: int,
        layout: BatchLayout | None = None,
    ) -> None:
        """`generate()`'s prefill (its first token through `choose`), then the pieces' steps.
        `layout` is not followed (the engine decodes a logged layout with `GenerateDecoder`)."""
        self._top_k = top_k
        first: list[tuple[int, bool]] = []

        def choose_first(out: StepOutput) -> tuple[int, bool]:
            first.append(choose(out))
            return first[-1]

        self.reference.run(context, 1, choose_first, top_k, keep_cache=True)
        token, stop = first[0]
        self._start(self.reference.cache, len(context))
        self.reference.cache = None
        for _ in range(1, max_new_tokens):
            if stop:
                break
            token, stop = choose(self.step(token))
        self.cache, self.kv = None, []

    def _start(self, cache: Any, position: int) -> None:
        """Continue from `generate()`'s cache after a prefill of `position` tokens."""
        self._position = position
        if self.direct is not None:
            self.kv = [[layer.keys, layer.values] for layer in cache.layers]
            self.cache = None
        else:
            self.cache = cache

    def step(self, token: int) -> StepOutput:
        """One token at the next position, without torch's deterministic NaN-filling of fresh
        buffers, as the graphs were captured (`_capture`)."""
        if self._want_graphs and not self.graphs and self.capture_error is None:
            self._capture()
        deterministic: Any = torch.utils.deterministic
        fill = deterministic.fill_uninitialized_memory
        deterministic.fill_uninitialized_memory = False
        try:
            self.token.fill_(token)
            self.position.fill_(self._position)
            self._run(0)
            if self.direct is not None:
                self._direct_attention(self.direct)
            else:
                self._cache_attention()
            self._position += 1
        finally:
            deterministic.fill_uninitialized_memory = fill
        assert self._last is not None
        return captured_step_output(*self._last, self._top_k)

    def _direct_attention(self, options: attention.SdpaOptions) -> None:
        """Each layer's attention, SDPA called with `generate()`'s options. Only layer 0's call
        is observed (the backend torch picks at this length); the others, the same call on
        other tensors, go straight to torch (the step is host-bound), in `check` as in every
        decode."""
        observed = torch.nn.functional.scaled_dot_product_attention
        plain = attention.unobserved()
        for i, ((_, _, _, out_buffer), kv) in enumerate(
            zip(self._attention_args, self.kv, strict=True)
        ):
            assert self._qkv is not None
            q, new = self._qkv
            kv[0] = torch.cat([kv[0], new[0]], dim=-2)
            kv[1] = torch.cat([kv[1], new[1]], dim=-2)
            sdpa = observed if i == 0 else plain
            out = options.call(sdpa, q, kv[0], kv[1])
            # transformers' (batch, heads, 1, dim) -> transpose(1, 2).contiguous() -> reshape
            # (batch, 1, heads * dim): for one query token, the same element order.
            out_buffer.copy_(out.reshape(out_buffer.shape))
            self._run(i + 1)

    def _cache_attention(self) -> None:
        """Each layer's attention: transformers' function on the `DynamicCache`, with a mask."""
        positions = self.position.expand(self.body.batch_size, -1)
        cache = self.cache
        mask = self._mask(
            config=self.config,
            inputs_embeds=self._h,
            attention_mask=None,
            **{cache_keyword(self._mask): cache},
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
        """Decode `steps` steps after `context` with `generate()` and here (fed its tokens), and
        compare each step's hidden state and logits bitwise and its observed SDPA call
        argument for argument, after learning the direct call's options from `generate()`'s
        calls. `check_result` says "bitwise" or where they first differ."""
        ref: list[StepOutput] = []

        def follow(out: StepOutput) -> tuple[int, bool]:
            ref.append(_copy(out))
            return int(out.top.native[0]), False

        with attention.observe(keep_calls=True) as seen:
            self.reference.run(context, steps + 1, follow, 2)
        ref_calls = [c for c in seen.calls if c.phase == "decode"]
        self.direct = direct_options(ref_calls, len(self.layers))
        tokens = iter([int(o.top.native[0]) for o in ref])
        outs: list[StepOutput] = []

        def replay(out: StepOutput) -> tuple[int, bool]:
            outs.append(_copy(out))  # a step's tensors are the graphs' buffers: kept as they are
            return next(tokens), False

        with attention.observe(keep_calls=True) as mine:
            self.run(context, steps + 1, replay, 2)
        calls = [c for c in mine.calls if c.phase == "decode"]
        layers = 1 if self.direct is not None else len(self.layers)
        for t, (a, b) in enumerate(zip(outs, ref, strict=True)):
            if t:  # layer 0's call of the step (every layer's without the direct call)
                step = slice((t - 1) * layers, t * layers)
                theirs = ref_calls[(t - 1) * len(self.layers) :][:layers]
                if calls[step] != theirs:
                    self.check_result = (
                        f"step {t} calls SDPA otherwise than generate(): "
                        f"{_first_difference(calls[step], theirs)}"
                    )
                    return False
            if not (torch.equal(a.logits, b.logits) and torch.equal(a.hidden[:1], b.hidden[:1])):
                diff = (a.logits - b.logits).abs().max().item()
                self.check_result = (
                    f"step {t} differs from generate() (max |logit diff| {diff:.3g})"
                )
                return False
        self.check_result = "bitwise"
        return True

    # -- the pieces -----------------------------------------------------------------------

    def _project(
        self, i: int, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Layer i's input norm, q/k/v and RoPE, as `LlamaAttention.forward`; k and v stacked."""
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
        """The rest of layer i after its attention, as `LlamaDecoderLayer.forward`."""
        layer = self.layers[i]
        hidden = residual + layer.self_attn.o_proj(self.attn_out[i])
        out: torch.Tensor = hidden + layer.mlp(layer.post_attention_layernorm(hidden))
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
        """Capture every piece in its own CUDA graph, in step order, on one side stream and one
        memory pool (the graphs replay in that order, never concurrently), each warmed up
        uncaptured first (cuBLAS's handle and workspace for that stream). The values held
        during capture do not matter: no piece touches the cache.

        Captured without torch's deterministic NaN-filling of memory `empty` allocates (a few
        hundred tiny kernels per step that change no value: every op overwrites it); `check`
        compares the result with the dynamic path, which fills."""
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


def _copy(out: StepOutput) -> StepOutput:
    return StepOutput(out.hidden.clone(), out.logits.clone(), out.top)


def direct_options(
    calls: Sequence[attention.SdpaCall], layers: int
) -> attention.SdpaOptions | None:
    """SDPA's options of `generate()`'s decode `calls` where the direct call can follow them
    (no mask, one set of options, one call per layer per step); else None."""
    if not calls or len(calls) % layers or any(c.mask is not None for c in calls):
        return None
    if len({c.options for c in calls}) != 1:
        return None
    return calls[0].options


def _first_difference(a: Sequence[attention.SdpaCall], b: Sequence[attention.SdpaCall]) -> str:
    """Which layer's call differs, and in which arguments (here; in generate())."""
    for i, (x, y) in enumerate(zip(a, b, strict=False)):
        if x != y:
            fields = ("query", "key", "value", "mask", "options", "backend")
            parts = [
                f"{f} {getattr(x, f)} here, {getattr(y, f)} in generate()"
                for f in fields
                if getattr(x, f) != getattr(y, f)
            ]
            return f"layer {i}: " + "; ".join(parts)
    return f"{len(a)} calls here, {len(b)} in generate()"
