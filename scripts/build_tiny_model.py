#!/usr/bin/env python3
r"""Build the tiny Qwen2 model that the real-vLLM test tier serves (nothing from a hub).

    python scripts/build_tiny_model.py [DIR]      # default ${GENQUEUE_CACHE:-~/.cache/genqueue}/tiny-qwen2
    python scripts/build_tiny_model.py DIR --mode random

Runs with the vLLM virtualenv's python (transformers, tokenizers and torch come with vLLM).
Building again is a no-op while DIR holds a model built by this same script (a stamp file
records the script's hash). Prints DIR.

What it makes (about 1 MB):
- a byte-level BPE tokenizer trained here with `tokenizers` on generated text (1,024 BPE
  tokens), ChatML specials `<|endoftext|>`, `<|im_start|>`, `<|im_end|>`, and Qwen's
  plain-text (non-special) added tokens `<think>`, `</think>`, `<tool_call>`, `</tool_call>`,
  `<tool_response>`, `</tool_response>`: decoding keeps them in the text, as Qwen3 does;
- a Qwen3-style ChatML chat template: system/user/assistant/tool roles, `tools`, tool calls,
  earlier assistant turns rendered (their thinking, from `reasoning`/`reasoning_content` or an
  inline block, dropped before the last user turn as Qwen3's template does, or kept with
  `chat_template_kwargs={"preserve_thinking": true}` as interleaved-thinking templates do), and
  `enable_thinking` (default true): the generation prompt then ends `<|im_start|>assistant\n<think>`
  so the model answers inside the thinking, as Qwen3-Thinking-2507 / DeepSeek-R1 templates do;
  `chat_template_kwargs={"enable_thinking": false}` ends it with `<|im_start|>assistant\n`;
- a Qwen2 model (2 layers, hidden 128, 4 heads, 2 KV heads, head size 32): the layers hold
  random weights (seeded), and the embeddings and output head are set so that the next token
  depends mostly on the last one's class, which makes the random text well-formed:
  after `<think>`: thinking tokens, each followed by `</think>` with probability ~0.15
  (at temperature 0.8; ~0.10 at 1.0, ~0.27 at 0.6), never by the end of turn; after `</think>`
  or the prompt's final newline: at least one answer token, each followed by `<|im_end|>` with
  the same probability; `<think>` and text holding `<`/`>` are never generated. So a thinking answer
  is "<random thinking></think><random answer>" and stops by itself within a few dozen tokens,
  and max_tokens=1 always stops inside the thinking.

`--mode random` builds the same tokenizer and template around a model that is random through
and through (4 layers, every weight drawn at std RANDOM_STD, seeded): each layer moves the hidden
state by about as much as it holds, so features captured from the engine can be told apart layer
by layer and position by position. The scripted model's layers barely move it (std 0.02 against
embeddings of scale 1-6: two layers differ by ~0.13 at bf16 steps of 0.03), and its text is what
the other tests rely on; the random model's text is noise and need not stop by itself.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import random
import shutil
import sys
import tempfile
from pathlib import Path

SEED = 1234
BPE_VOCAB = 1024
SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
PLAIN_ADDED = ["<think>", "</think>", "<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>"]
HIDDEN, LAYERS, HEADS, KV_HEADS, INTERMEDIATE = 128, 2, 4, 2, 256
RANDOM_LAYERS, RANDOM_STD = 4, 0.1
MODES = ("scripted", "random")
#: Tokens per class the model generates from; small classes keep the end probabilities
#: close across temperatures.
CLASS_SIZE = 64
#: Probability of `</think>` after a thinking token and of `<|im_end|>` after an answer token,
#: at temperature DESIGN_T (log-odds scale as 1/T).
P_END, DESIGN_T = 0.15, 0.8
NOISE_LOGIT = 0.5  # spread of logits within a class (random text, not one repeated token)
NEVER = -60.0

CHAT_TEMPLATE = (
    "{%- if tools %}"
    "{{- '<|im_start|>system\\n' }}"
    "{%- if messages[0].role == 'system' %}{{- messages[0].content + '\\n\\n' }}{%- endif %}"
    "{{- '# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\n"
    "You are provided with function signatures within <tools></tools> XML tags:\\n<tools>' }}"
    "{%- for tool in tools %}{{- '\\n' }}{{- tool | tojson }}{%- endfor %}"
    "{{- '\\n</tools>\\n\\nFor each function call, return a json object with function name and "
    "arguments within <tool_call></tool_call> XML tags:\\n<tool_call>\\n"
    "{\"name\": <function-name>, \"arguments\": <args-json-object>}\\n</tool_call><|im_end|>\\n' }}"
    "{%- elif messages[0].role == 'system' %}"
    "{{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- set ns = namespace(last_query=-1) %}"
    "{%- for m in messages %}{%- if m.role == 'user' %}{%- set ns.last_query = loop.index0 %}{%- endif %}"
    "{%- endfor %}"
    "{%- for message in messages %}"
    "{%- set content = message.content if message.content is string else '' %}"
    "{%- if message.role == 'system' %}"
    "{%- if not loop.first %}{{- '<|im_start|>system\\n' + content + '<|im_end|>\\n' }}{%- endif %}"
    "{%- elif message.role == 'user' %}"
    "{{- '<|im_start|>user\\n' + content + '<|im_end|>\\n' }}"
    "{%- elif message.role == 'assistant' %}"
    "{%- set reasoning = '' %}"
    "{%- if message.reasoning_content is string %}{%- set reasoning = message.reasoning_content %}"
    "{%- elif message.reasoning is string %}{%- set reasoning = message.reasoning %}{%- endif %}"
    "{%- if '</think>' in content %}"
    "{%- set reasoning = content.split('</think>')[0].split('<think>')[-1].strip('\\n') %}"
    "{%- set content = content.split('</think>')[-1].lstrip('\\n') %}"
    "{%- endif %}"
    "{{- '<|im_start|>assistant\\n' }}"
    "{%- if reasoning and (loop.index0 > ns.last_query or (preserve_thinking is defined and preserve_thinking)) %}"
    "{{- '<think>\\n' + reasoning.strip('\\n') + '\\n</think>\\n\\n' }}"
    "{%- endif %}"
    "{{- content }}"
    "{%- for tc in message.tool_calls or [] %}"
    "{%- set f = tc.function if tc.function is defined else tc %}"
    "{%- if loop.first and content %}{{- '\\n' }}{%- endif %}"
    "{{- '<tool_call>\\n{\"name\": \"' + f.name + '\", \"arguments\": ' }}"
    "{%- if f.arguments is string %}{{- f.arguments }}{%- else %}{{- f.arguments | tojson }}{%- endif %}"
    "{{- '}\\n</tool_call>' }}"
    "{%- endfor %}"
    "{{- '<|im_end|>\\n' }}"
    "{%- elif message.role == 'tool' %}"
    "{%- if loop.first or messages[loop.index0 - 1].role != 'tool' %}{{- '<|im_start|>user' }}{%- endif %}"
    "{{- '\\n<tool_response>\\n' + content + '\\n</tool_response>' }}"
    "{%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}{{- '<|im_end|>\\n' }}{%- endif %}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}"
    "{{- '<|im_start|>assistant\\n' }}"
    "{%- if enable_thinking is not defined or enable_thinking %}{{- '<think>' }}{%- endif %}"
    "{%- endif %}"
)

WORDS = ["the", "of", "and", "to", "in", "is", "that", "for", "it", "as", "was", "with", "be", "by", "on", "not", "he", "this", "are", "or", "his", "from", "at", "which", "but", "have", "an", "they", "you", "were", "her", "she", "there", "been", "one", "all", "we", "their", "has", "would", "when", "if", "so", "no", "will", "more", "can", "about", "what", "up", "said", "out", "into", "them", "time", "some", "could", "very", "my", "other", "only", "new", "these", "two", "may", "first", "then", "do", "any", "like", "our", "now", "over", "such", "after", "also", "most", "made", "many", "before", "must", "through", "back", "years", "where", "much", "your", "way", "well", "down", "should", "because", "each", "just", "those", "people", "how", "too", "little", "state", "good", "very", "make", "world", "still", "own", "see", "men", "work", "long", "get", "here", "between", "both", "life", "being", "under", "never", "day", "same", "another", "know", "while", "last", "might", "us", "great", "old", "year", "off", "come", "since", "against", "go", "came", "right", "used", "take", "three", "small", "large", "number", "water", "answer", "question", "reason", "think", "step", "model", "token", "data", "train", "value", "system", "function", "result", "example", "explain", "first", "second", "third", "because", "therefore", "however", "consider", "suppose", "check", "compute", "sum", "list", "item", "order", "count", "zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine", "ten", "hundred", "thousand"]


def stamp_value(mode: str = "scripted") -> str:
    digest = hashlib.sha256(Path(__file__).read_bytes()).hexdigest()
    return digest if mode == "scripted" else f"{digest} {mode}"


def default_dir() -> Path:
    cache = os.environ.get("GENQUEUE_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "genqueue")
    return Path(cache) / "tiny-qwen2"


def corpus(n: int = 20000) -> list[str]:
    rng = random.Random(SEED)
    lines = []
    for _ in range(n):
        words = [rng.choice(WORDS) for _ in range(rng.randint(4, 16))]
        if rng.random() < 0.3:
            words.insert(rng.randrange(len(words)), str(rng.randint(0, 9999)))
        line = " ".join(words)
        line = line[0].upper() + line[1:] + rng.choice([".", ".", "?", "!", ":", ","])
        if rng.random() < 0.2:
            line += "\n"
        lines.append(line)
    return lines


def build_tokenizer():
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=BPE_VOCAB, special_tokens=SPECIAL, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(corpus(), trainer=trainer)
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in PLAIN_ADDED])
    return tok


def token_classes(tok) -> dict[str, list[int]]:
    """Which ids the model generates in the thinking (A) and in the answer (B)."""
    vocab = tok.get_vocab()
    specials = set(SPECIAL) | set(PLAIN_ADDED)
    ok = []
    for text, i in vocab.items():
        if text in specials:
            continue
        s = tok.decode([i])
        if not s or "\ufffd" in s or "<" in s or ">" in s:
            continue
        if not all(c == "\n" or 32 <= ord(c) < 127 for c in s):
            continue
        ok.append((i, s))
    # Wordy tokens: prefer longer pieces that start with a space, so text reads like words.
    ok.sort(key=lambda t: (-(t[1].startswith(" ") and t[1][1:].isalpha()), -len(t[1]), t[0]))
    pool = [i for i, _ in ok[: 2 * CLASS_SIZE]]
    newline = vocab["\u010a"]  # byte-level "\n": the last token of "<|im_start|>assistant\n"
    a = pool[0::2]
    b = [i for i in pool[1::2] if i != newline]
    return {"A": a, "B": b, "newline": [newline]}


def build(out: Path, mode: str = "scripted") -> None:
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(SEED)
    tok = build_tokenizer()
    ids = {t: tok.token_to_id(t) for t in SPECIAL + PLAIN_ADDED}
    n_tok = tok.get_vocab_size()
    vocab_size = (n_tok + 63) // 64 * 64
    classes = token_classes(tok)

    random_mode = mode == "random"
    config = Qwen2Config(
        vocab_size=vocab_size, hidden_size=HIDDEN, intermediate_size=INTERMEDIATE,
        num_hidden_layers=RANDOM_LAYERS if random_mode else LAYERS, num_attention_heads=HEADS,
        num_key_value_heads=KV_HEADS,
        max_position_embeddings=2048, rope_theta=10000.0, rms_norm_eps=1e-6,
        tie_word_embeddings=False, bos_token_id=ids["<|endoftext|>"], eos_token_id=ids["<|im_end|>"],
        pad_token_id=ids["<|endoftext|>"], torch_dtype="bfloat16", use_sliding_window=False,
        **({"initializer_range": RANDOM_STD} if random_mode else {}),
    )
    model = Qwen2ForCausalLM(config)  # random layers (initializer_range 0.02), seeded above
    if random_mode:
        with torch.no_grad():  # biases and norms start at 0 and 1: random too, so nothing is neutral
            for name, p in model.named_parameters():
                if p.dim() == 1:
                    p.copy_(torch.randn_like(p) * RANDOM_STD + (1.0 if name.endswith("norm.weight") else 0.0))
        save(out, model.to(torch.bfloat16), tok, ids, {"mode": mode, "vocab_size": vocab_size,
                                                       "tokenizer_size": n_tok, "ids": ids}, mode)
        return

    # Embedding: dims 0..3 say the token's class (as the previous token), the rest is noise of
    # fixed norm, so every token's RMS-normed hidden state has the same class coordinate.
    OPEN, THINK, CLOSE, ANSWER = range(4)
    s, n_noise = 6.0, HIDDEN - 4
    frm = torch.full((vocab_size,), ANSWER, dtype=torch.long)
    frm[ids["<think>"]] = OPEN
    frm[classes["A"]] = THINK
    frm[ids["</think>"]] = CLOSE
    frm[classes["newline"]] = CLOSE  # "<|im_start|>assistant\n" without thinking: an answer of 1+ tokens
    noise = torch.randn(vocab_size, n_noise)
    noise = noise / noise.norm(dim=1, keepdim=True) * math.sqrt(n_noise)
    emb = torch.zeros(vocab_size, HIDDEN)
    emb[torch.arange(vocab_size), frm] = s
    emb[:, 4:] = noise
    rms = math.sqrt((s * s + n_noise) / HIDDEN)
    h_class, h_noise = s / rms, 1.0 / rms  # normed coordinates

    # Output head: logit(next | prev class c) = L[c, class(next)] + noise.
    def end_logit(p: float, n: int) -> float:
        spread = NOISE_LOGIT ** 2 / (2 * DESIGN_T ** 2)
        return DESIGN_T * (math.log(p / (1 - p)) + math.log(n) + spread)

    l_close = end_logit(P_END, len(classes["A"]))
    l_eos = end_logit(P_END, len(classes["B"]))
    L = torch.full((4, vocab_size), NEVER)
    L[OPEN, classes["A"]] = 0.0
    L[THINK, classes["A"]] = 0.0
    L[THINK, ids["</think>"]] = l_close
    L[CLOSE, classes["B"]] = 0.0
    L[ANSWER, classes["B"]] = 0.0
    L[ANSWER, ids["<|im_end|>"]] = l_eos
    head = torch.zeros(vocab_size, HIDDEN)
    head[:, :4] = L.T / h_class
    gen = classes["A"] + classes["B"]
    head[gen, 4:] = torch.randn(len(gen), n_noise) * (NOISE_LOGIT / (h_noise * math.sqrt(n_noise)))
    with torch.no_grad():
        model.model.embed_tokens.weight.copy_(emb)
        model.lm_head.weight.copy_(head)
    model = model.to(torch.bfloat16)
    save(out, model, tok, ids, {"classes": {k: len(v) for k, v in classes.items()}, "logit_close": l_close,
                                "logit_eos": l_eos, "ids": ids, "vocab_size": vocab_size, "tokenizer_size": n_tok},
         mode)


def save(out: Path, model, tok, ids: dict[str, int], about: dict, mode: str) -> None:
    from transformers import PreTrainedTokenizerFast

    hf_tok = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>",
                                     model_max_length=2048, clean_up_tokenization_spaces=False)
    hf_tok.chat_template = CHAT_TEMPLATE
    tmp = Path(tempfile.mkdtemp(prefix=".tiny-qwen2-", dir=out.parent))
    try:
        model.save_pretrained(tmp, safe_serialization=True)
        hf_tok.save_pretrained(tmp)
        gen_cfg = {"bos_token_id": ids["<|endoftext|>"], "eos_token_id": [ids["<|im_end|>"], ids["<|endoftext|>"]],
                   "pad_token_id": ids["<|endoftext|>"]}
        (tmp / "generation_config.json").write_text(json.dumps(gen_cfg, indent=2) + "\n")
        (tmp / "genqueue-tiny.json").write_text(json.dumps(about, indent=2) + "\n")
        (tmp / ".built").write_text(stamp_value(mode) + "\n")
        tmp.chmod(0o755)
        if out.exists():
            shutil.rmtree(out)
        tmp.rename(out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def main() -> int:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    parser = argparse.ArgumentParser(description="Build the tiny model the real-vLLM tier serves.")
    parser.add_argument("dir", nargs="?", type=Path, default=None)
    parser.add_argument("--mode", choices=MODES, default="scripted")
    args = parser.parse_args()
    out = (args.dir or default_dir()).expanduser().resolve()
    stamp = out / ".built"
    if stamp.exists() and stamp.read_text().strip() == stamp_value(args.mode):
        print(out)
        return 0
    out.parent.mkdir(parents=True, exist_ok=True)
    build(out, args.mode)
    print(out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
