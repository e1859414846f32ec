"""Generate text with a trained run or a Hugging Face Llama, tensor parallel over N devices; or a VLA
run's action for one step of an episode.

    python -m jaxpar.generate (--workdir W [--checkpoint_step N] | --from_hf DIR)
        (--prompt TEXT [--chat] | --prompt_ids 1,2,3) [--max_new_tokens N] [--temperature T] [--top_p P]
        [--seed S] [--tp N] [--cp N] [--json]
    python -m jaxpar.generate --workdir VLA_RUN --episode episode_00000.npz --step K [--json]

The prompt is run through the model once (prefill, filling the KV cache), then one token per step
(jaxpar.inference.decode). Temperature 0 is greedy; otherwise the logits are divided by the
temperature and sampled from the smallest set of tokens whose probability reaches top_p (nucleus).
With --tp N the weights, KV cache and heads are split over N devices exactly as in training
(emulated on CPU). With --cp N the prefill is also split over N x tp devices by context parallelism (each
runs its balanced chunks of the prompt, padded to 2 N chunks, against the whole prompt's K / V); every
cp rank then holds the whole cache and decodes alike.

--prompt needs a tokenizer: the run's (from its training data) or DIR/tokenizer.json, and is encoded
as the tokenizer means it, special tokens included: a Llama tokenizer.json's template puts BOS first,
as transformers' `tokenizer(TEXT)` does, and a model continues a prompt without its BOS differently.
A run encodes prompts as its training text was encoded (jaxpar.data.text). --chat wraps the prompt
as one user message in the tokenizer's chat template (DIR/chat_template.jinja, or
tokenizer_config.json's `chat_template`) with the assistant's turn opened, as transformers'
`apply_chat_template(messages, add_generation_prompt=True)` does; the template writes the special
tokens itself, so the rendered text is encoded without the tokenizer's own.

Generation stops at any end-of-sequence id, read as transformers' generate reads them:
DIR/generation_config.json's `eos_token_id` (one id or a list: Llama-3-Instruct ends its turns with
<|eot_id|>, not its first id <|end_of_text|>), else config.json's; for a run, its text's
end-of-document id and, when it kept its Hugging Face model's tokenizer, that model's ids
(jaxpar.inference.loader.run_eos_ids, which the export writes to generation_config.json).
"""

from __future__ import annotations

import dataclasses
import json
import pathlib

from jaxpar.cli import OneLineArgumentParser, main_with_one_line_errors
from jaxpar.errors import ConfigError

USAGE = ("(--workdir W [--checkpoint_step N] | --from_hf DIR) "
         "(--prompt TEXT [--chat] | --prompt_ids 1,2,3 | --episode FILE --step K) "
         "[--max_new_tokens N] [--temperature T] [--top_p P] [--seed S] [--tp N] [--json]")


def parse_args(argv: list[str]):
    parser = OneLineArgumentParser(prog="python -m jaxpar.generate", usage_hint=USAGE)
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--workdir")
    source.add_argument("--from_hf")
    prompt = parser.add_mutually_exclusive_group(required=True)
    prompt.add_argument("--prompt")
    prompt.add_argument("--prompt_ids")
    prompt.add_argument("--episode")  # a VLA run: predict the action of --step K of this episode file
    parser.add_argument("--step", type=int, default=0)  # the episode step whose action --episode predicts
    parser.add_argument("--chat", action="store_true")  # --prompt as a user message in the chat template
    parser.add_argument("--checkpoint_step", type=int, default=None)  # default: the latest checkpoint
    parser.add_argument("--max_new_tokens", type=int, default=32)
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--top_p", type=float, default=1.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--tp", type=int, default=1)
    parser.add_argument("--cp", type=int, default=1)  # context parallelism for the prompt's prefill
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    if args.max_new_tokens < 1 or args.tp < 1 or args.temperature < 0 or not 0 < args.top_p <= 1:
        raise ConfigError("--max_new_tokens and --tp must be >= 1, --temperature >= 0 and 0 < --top_p <= 1")
    if args.chat and args.prompt is None:
        raise ConfigError("--chat wraps --prompt TEXT in the chat template; it does not apply to --prompt_ids "
                          "or --episode")
    return args


def _tokenizer(args, config):
    """An object with encode / decode, or None when there is none to use. DIR/tokenizer.json encodes
    with its template (BOS), as transformers does; a run's, as its training text was encoded."""
    from jaxpar.data.text import HFTokenizer
    from jaxpar.inference.loader import run_tokenizer

    if args.from_hf:
        path = pathlib.Path(args.from_hf) / "tokenizer.json"
        return HFTokenizer(path, special_tokens=True, need_eos=False) if path.is_file() else None
    return run_tokenizer(config)


def _eos(args, config, tokenizer) -> list[int]:
    """Every id generation stops at: a Hugging Face directory's as transformers reads them, a run's
    (jaxpar.inference.loader.run_eos_ids)."""
    from jaxpar.inference.loader import hf_eos_ids, run_eos_ids

    return hf_eos_ids(args.from_hf) if args.from_hf else run_eos_ids(config, tokenizer)


def _prompt_ids(args, tokenizer, vocab_size: int) -> list[int]:
    if args.prompt_ids is not None:
        try:
            ids = [int(x) for x in args.prompt_ids.split(",") if x.strip()]
        except ValueError:
            raise ConfigError(f"--prompt_ids '{args.prompt_ids}' is not a comma-separated list of integers") from None
    elif tokenizer is None:
        raise ConfigError("--prompt needs a tokenizer and this model has none (no tokenizer.json, or a run on "
                          "synthetic data); pass --prompt_ids instead")
    elif args.chat:
        ids = [int(i) for i in tokenizer.encode(chat_prompt(tokenizer, args.prompt), special_tokens=False)]
    else:
        ids = [int(i) for i in tokenizer.encode(args.prompt)]
    if not ids or min(ids) < 0 or max(ids) >= vocab_size:
        raise ConfigError(f"the prompt must be at least one id in [0, {vocab_size}); got {ids[:8]}")
    return ids


SPECIAL_TOKENS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")


def chat_template(directory: pathlib.Path) -> tuple[str | None, dict]:
    """(the chat template, the named special tokens it may use) of a tokenizer directory, where
    transformers looks: chat_template.jinja first, then tokenizer_config.json's `chat_template` (a
    string, or a list of named templates whose "default" is used)."""
    config_path = directory / "tokenizer_config.json"
    config = json.loads(config_path.read_text()) if config_path.is_file() else {}
    specials = {}
    for key in SPECIAL_TOKENS:
        value = config.get(key)
        if value is not None:
            specials[key] = value["content"] if isinstance(value, dict) else str(value)
    if (directory / "chat_template.jinja").is_file():
        return (directory / "chat_template.jinja").read_text(encoding="utf-8"), specials
    template = config.get("chat_template")
    if isinstance(template, list):
        template = next((t["template"] for t in template if t.get("name") == "default"), None)
    return template, specials


def chat_prompt(tokenizer, text: str) -> str:
    """`text` as one user message rendered by the tokenizer's chat template with the assistant's turn
    opened: transformers' apply_chat_template(add_generation_prompt=True), in the same sandboxed Jinja
    environment (trim_blocks, lstrip_blocks, its tojson / raise_exception / strftime_now)."""
    from jaxpar.data.text import HFTokenizer

    directory = pathlib.Path(tokenizer.name).parent
    template, specials = chat_template(directory) if isinstance(tokenizer, HFTokenizer) else (None, {})
    if not template:
        raise ConfigError(f"--chat: {directory if isinstance(tokenizer, HFTokenizer) else tokenizer.name} has no "
                          f"chat template (chat_template.jinja or tokenizer_config.json's chat_template); drop --chat")
    try:
        import jinja2.ext
        from jinja2.sandbox import ImmutableSandboxedEnvironment
    except ImportError:
        raise ConfigError("--chat renders the chat template with Jinja: pip install jinja2") from None
    import datetime

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols])
    env.filters["tojson"] = lambda x, ensure_ascii=False, indent=None, separators=None, sort_keys=False: json.dumps(
        x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)
    env.globals.update(raise_exception=raise_exception, strftime_now=lambda f: datetime.datetime.now().strftime(f))
    try:
        return env.from_string(template).render(messages=[{"role": "user", "content": text}], tools=None,
                                                documents=None, add_generation_prompt=True, **specials)
    except jinja2.exceptions.TemplateError as error:
        raise ConfigError(f"--chat: {directory}'s chat template failed: {error}") from None


def load(args):
    """(model config, weights laid out for a tp mesh, the mesh, tokenizer, eos id)."""
    import jax

    from jaxpar.interop import hf_llama
    from jaxpar.config import Config, MeshConfig, ModelConfig
    from jaxpar.parallel.mesh import Layout

    if args.from_hf:
        model = ModelConfig(**hf_llama.model_fields(args.from_hf))
        config, weights = Config(model=model, mesh=MeshConfig(tp=args.tp)), None
    else:
        from jaxpar.inference.loader import restore_weights

        config, _, weights = restore_weights(pathlib.Path(args.workdir), args.checkpoint_step)
        if config.model.kind != "llama":
            raise ConfigError(f"{args.workdir} trained a {config.model.kind}; generation reads Llama runs only so far")
        model = config.model
    for key in ("n_heads", "vocab_size", "d_ff"):
        if getattr(model, key) % args.tp:
            raise ConfigError(f"--tp {args.tp} does not divide model.{key}={getattr(model, key)}")
    if args.tp % model.n_kv_heads and model.n_kv_heads % args.tp:
        raise ConfigError(f"--tp {args.tp} and n_kv_heads={model.n_kv_heads}: one must divide the other")
    if args.cp < 1:
        raise ConfigError(f"--cp {args.cp} must be >= 1")
    layout = Layout(dp=1, pp=1, tp=args.tp, cp=args.cp)
    mesh = layout.make_mesh()
    shardings = weight_shardings(mesh, model)
    if weights is None:
        weights = hf_llama.load_weights(args.from_hf, model, shardings)
    else:
        weights = jax.device_put(weights, shardings)
    tokenizer = _tokenizer(args, config)
    return model, weights, mesh, tokenizer, _eos(args, config, tokenizer)


def weight_shardings(mesh, model):
    """Where each weight goes on a (1, 1, tp) mesh: the training layout's tp split, no ZeRO."""
    import jax
    from jax.sharding import NamedSharding

    from jaxpar.models import llama
    from jaxpar.sharding import is_axes_leaf, llm_rules, logical_to_spec, unused_mesh_axes

    rules = llm_rules(mesh, model.n_kv_heads)  # an unsplit tp: KV heads whole on every rank when tp > K
    return jax.tree.map(lambda axes: NamedSharding(mesh, logical_to_spec(axes, False, unused_mesh_axes(mesh), rules)),
                        llama.param_axes(), is_leaf=is_axes_leaf)


def generate(model, weights, mesh, prompt_ids: list[int], max_new_tokens: int, temperature: float = 0.0,
             top_p: float = 1.0, seed: int = 0, eos_id: int | list[int] | None = None) -> list[int]:
    """The new token ids (one sequence), stopping after `max_new_tokens` or at `eos_id` (one id, or
    any of several: a model may end a sequence with more than one token). On a mesh with a "cp" axis
    the prompt's prefill is split over cp (_prefill); decoding runs the same on every cp rank."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import PartitionSpec as P

    from jaxpar.layers.collectives import Collectives
    from jaxpar.inference import decode
    from jaxpar.sharding import kv_heads_replicated

    tp, cp = mesh.shape["tp"], mesh.shape.get("cp", 1)
    replicated = kv_heads_replicated(model.n_kv_heads, tp)
    coll = Collectives(tp_axis="tp", kv_heads_replicated=replicated)  # (a size-1 axis too: the cache is typed by it)
    local_kv = 1 if replicated else model.n_kv_heads // tp
    padded = -(-len(prompt_ids) // (2 * cp)) * 2 * cp  # cp's 2 cp chunks (the padding is never attended to)
    max_len = padded + max_new_tokens
    weight_specs = jax.tree.map(lambda s: s.spec, weight_shardings(mesh, model))
    cache_spec = {"k": P(None, None, None, "tp"), "v": P(None, None, None, "tp")}

    def local_step(params, ids, cache, start):  # the last position's logits: this rank's vocab slice
        logits, cache = decode.forward(params, ids, cache, start, model, coll)
        return logits[:, -1], cache

    step = jax.jit(jax.shard_map(local_step, mesh=mesh, in_specs=(weight_specs, P(), cache_spec, P()),
                                 out_specs=(P(None, "tp"), cache_spec)), donate_argnums=2)
    cache = jax.jit(lambda: decode.init_cache(model, 1, max_len, local_kv * tp),
                    out_shardings=jax.tree.map(lambda s: jax.NamedSharding(mesh, s), cache_spec))()
    stop = {eos_id} if isinstance(eos_id, int) else set(eos_id or ())
    key = jax.random.key(seed)
    ids, start, new = jnp.asarray([prompt_ids], jnp.int32), 0, []
    for i in range(max_new_tokens):
        if i == 0 and cp > 1:
            prefill = _prefill(model, mesh, dataclasses.replace(coll, context_axis="cp"), weight_specs, cache_spec,
                               len(prompt_ids))
            logits, cache = prefill(weights, jnp.pad(ids, ((0, 0), (0, padded - ids.shape[1]))), cache)
        else:
            logits, cache = step(weights, ids, cache, jnp.int32(start))
        token = int(_sample(logits[0], temperature, top_p, jax.random.fold_in(key, i)))
        new.append(token)
        if token in stop:
            break
        start += ids.shape[1]
        ids = jnp.asarray([[token]], jnp.int32)
    return new


def _prefill(model, mesh, coll, weight_specs, cache_spec, prompt_len: int):
    """The prompt's prefill split over cp: each rank runs its balanced chunks of the (padded) prompt,
    its queries against the whole prompt's K / V, which every rank caches (decode.py); returns the
    logits of the prompt's last token (held by one rank, summed over cp) and the cache."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import PartitionSpec as P

    from jaxpar.inference import decode

    def local_prefill(params, ids, cache):
        positions = coll.context_positions(ids.shape[1] // mesh.shape["cp"])
        logits, cache = decode.forward(params, jnp.take(ids, positions, axis=1), cache, 0, model, coll)
        last = jnp.einsum("btv,t->bv", logits, (positions == prompt_len - 1).astype(logits.dtype))
        return jax.lax.psum(last, "cp"), cache

    return jax.jit(jax.shard_map(local_prefill, mesh=mesh, in_specs=(weight_specs, P(), cache_spec),
                                 out_specs=(P(None, "tp"), cache_spec)), donate_argnums=2)


def _sample(logits_V, temperature: float, top_p: float, key):
    import jax
    import jax.numpy as jnp

    if temperature == 0:
        return jnp.argmax(logits_V)
    probs = jax.nn.softmax(logits_V / temperature)
    order = jnp.argsort(-probs)
    sorted_probs = probs[order]
    keep = jnp.cumsum(sorted_probs) - sorted_probs < top_p  # the smallest prefix reaching top_p
    choice = jax.random.categorical(key, jnp.where(keep, jnp.log(sorted_probs), -jnp.inf))
    return order[choice]


def predict_episode_action(args) -> dict:
    """A VLA run's greedy action for step `args.step` of an episode file (one device)."""
    import jax
    import numpy as np

    from jaxpar.data.instructions import InstructionEncoder
    from jaxpar.inference.loader import restore_weights
    from jaxpar.models import vla
    from jaxpar.inference import decode

    if not args.workdir:
        raise ConfigError("--episode needs --workdir (a VLA run)")
    config, _, weights = restore_weights(pathlib.Path(args.workdir), args.checkpoint_step)
    if config.model.kind != "vla":
        raise ConfigError(f"--episode needs a VLA run; {args.workdir} trained a {config.model.kind}")
    path = pathlib.Path(args.episode)
    if not path.is_file():
        raise ConfigError(f"--episode {path}: no such file")
    with np.load(path) as episode:
        images, instruction, actions = episode["images"], str(episode["instruction"]), episode["actions"]
        states = episode["state"] if "state" in episode.files else None
    if config.vision.state_dims and states is None:
        raise ConfigError(f"--episode {path} has no 'state' array, and this run's VLA reads the robot's state "
                          f"(vision.state_dims={config.vision.state_dims}); give an episode that records it")
    if not 0 <= args.step < len(images):
        raise ConfigError(f"--step {args.step} is outside {path}'s {len(images)} steps")
    image = np.asarray(images[args.step][None], np.uint8)  # uint8, as training feeds them (scaled on the device)
    text, film = InstructionEncoder.for_config(config).encode_batch([instruction], path)  # as training encoded it
    reads = (np.asarray(states[args.step][None], np.float32),) if config.vision.state_dims else ()  # the state
    out = np.asarray(jax.jit(decode.predict_actions, static_argnums=3)(weights, image, text, config, film, *reads)[0])[0]
    tokenizer = vla.ActionTokenizer(config.actions, config.model.vocab_size)
    chunk, dims = config.actions.chunk, config.actions.dims
    if config.actions.continuous:  # the values themselves, no tokens
        action = out.reshape(chunk, dims).astype(np.float64)
    else:
        action = tokenizer.from_bins(tokenizer.tokens_to_bins(out.reshape(chunk, dims)))  # [H, dims]
    recorded = actions[args.step:args.step + chunk]  # the episode's next H (fewer at its end)
    if chunk == 1:
        action, recorded = action[0], recorded[0]
    ids = {} if config.actions.continuous else {"action_ids": out.tolist()}
    return {**ids, "action": np.round(action, 6).tolist(),
            "recorded_action": np.round(recorded, 6).tolist()}


def run(argv: list[str]) -> int:
    args = parse_args(argv)
    if args.episode:
        result = predict_episode_action(args)
        flat = [a for row in result["action"] for a in (row if isinstance(row, list) else [row])]  # a chunk's rows
        print(json.dumps(result) if args.json else " ".join(f"{a:.4f}" for a in flat))
        return 0
    from jaxpar.parallel.mesh import emulate_cpu_devices

    import jax

    if jax.config.jax_num_cpu_devices < args.tp * args.cp:  # never fewer than a caller (e.g. a test) asked for
        try:
            emulate_cpu_devices(args.tp * args.cp)  # before JAX starts a backend (no-op for GPUs)
        except RuntimeError:  # called in a process whose backend is up: its devices are what there is
            pass
    model, weights, mesh, tokenizer, eos = load(args)
    prompt = _prompt_ids(args, tokenizer, model.vocab_size)
    new = generate(model, weights, mesh, prompt, args.max_new_tokens, args.temperature, args.top_p, args.seed, eos)
    text = tokenizer.decode(new) if tokenizer is not None else None
    if args.json:
        print(json.dumps({"prompt_ids": prompt, "new_ids": new, "text": text}))
    else:
        print(text if text is not None else " ".join(map(str, new)))
    return 0


def main(argv: list[str] | None = None) -> int:
    return main_with_one_line_errors(run, argv)

