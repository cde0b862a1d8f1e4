"""SmolLM2-135M-Instruct (or Gemma 3 270M) from its GGUF into a model folder vLLM and transformers
both load (run by setup.sh).

    python convert.py GGUF OUT_DIR

Weights: transformers dequantizes the Q4_1 GGUF to fp32 (`gguf_file=` with
GgufConfig(dequantize=True); bench/quality/evaluate.py load_model does the same with transformers
5.2, which always dequantized), and they are saved as fp32 safetensors (538 MB): the dequantized
values are kept as they are, so transformers' fp32 reference and vLLM read the same numbers; bf16
would round them (vLLM can still run the folder with dtype=bfloat16).

Tokenizer: the one transformers builds from the GGUF metadata is saved, then repaired against
that metadata (repair_tokenizer says what and why); Gemma 3's is rebuilt as the BPE its
SentencePiece model is before it is saved (gemma3_tokenizer).

Reused while OUT_DIR/source.json matches (GGUF name and size, this file's SHA-256).
"""

import hashlib
import json
import os
import sys


def log(*args) -> None:
    print(*args, file=sys.stderr, flush=True)


def gguf_fields(path: str) -> dict:
    """The scalar tokenizer.* and general.* metadata of the GGUF; of an array only its length,
    as NAME#count."""
    from gguf import GGUFReader
    from gguf.constants import GGUFValueType
    reader = GGUFReader(path)
    out = {}
    for name, field in reader.fields.items():
        if not name.startswith(("tokenizer.", "general.")):
            continue
        if field.types and field.types[0] == GGUFValueType.ARRAY:
            out[name + "#count"] = len(field.data)
            continue
        out[name] = field.contents()
    return out


# llama.cpp's pre-tokenizers (tokenizer.ggml.pre) as `tokenizers` pre-tokenizers: llama.cpp
# (src/llama-vocab.cpp) applies its regex list in order, each on the pieces of the one before.
# "smollm": "\\p{N}" (every digit alone), then the GPT-2 regex, which ByteLevel(use_regex=True)
# applies; this is also the pre-tokenizer of SmolLM2's own tokenizer.json (Digits, ByteLevel).
GGUF_PRE_TOKENIZERS = {
    "smollm": lambda: {"type": "Sequence", "pretokenizers": [
        {"type": "Split", "pattern": {"Regex": "\\p{N}"}, "behavior": "Isolated",
         "invert": False},
        {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True,
         "use_regex": True}]},
}


def repair_tokenizer(out: str, meta: dict) -> list[str]:
    """Rewrites the saved tokenizer files so that they say what the GGUF metadata says, whatever
    the transformers version that saved them; returns one line per change.

    transformers 5.2 (bench/quality's pin) saved this GGUF's byte-level (gpt2) vocabulary as a
    CodeLlamaTokenizer: tokenizer_class CodeLlamaTokenizer, whose loader rebuilds SentencePiece
    (Metaspace) pieces around a byte-level vocabulary; a ByteFallback/Fuse/Replace("▁") decoder
    sequence; a post-processor prepending <|im_start|> (the GGUF's BOS) to every text although
    tokenizer.ggml.add_bos_token is false; and eos_token <|im_start|>. transformers 5.19 saves a
    TokenizersBackend with a ByteLevel decoder and no BOS, but still a plain GPT-2 pre-tokenizer,
    not the GGUF's "smollm" one: "247 \\n12" and ",  6" (whitespace next to digits) tokenize
    differently. Hence every field below is set from the metadata, not patched.
    """
    from tokenizers import Tokenizer
    if meta.get("tokenizer.ggml.model") != "gpt2":
        raise ValueError(f"tokenizer.ggml.model {meta.get('tokenizer.ggml.model')!r}: only the "
                         "byte-level (gpt2) vocabulary is handled")
    pre = meta.get("tokenizer.ggml.pre")
    if pre not in GGUF_PRE_TOKENIZERS:
        raise ValueError(f"tokenizer.ggml.pre {pre!r} has no entry in GGUF_PRE_TOKENIZERS")
    changes = []
    path = os.path.join(out, "tokenizer.json")
    with open(path, encoding="utf-8") as f:
        tj = json.load(f)
    # Tokens past the GGUF's vocabulary (transformers 5.2 added CodeLlama's ▁<PRE>... at 49152+)
    # have no embedding row.
    size = meta["tokenizer.ggml.tokens#count"]
    extra = [t["content"] for t in tj["added_tokens"] if t["id"] >= size]
    if extra:
        changes.append(f"tokenizer.json added_tokens: dropped {extra} (ids >= {size})")
        tj["added_tokens"] = [t for t in tj["added_tokens"] if t["id"] < size]
    if max(tj["model"]["vocab"].values()) >= size:
        raise ValueError(f"the BPE vocabulary has ids >= the GGUF's {size} tokens")
    vocab = {t["content"]: t["id"] for t in tj["added_tokens"]} | tj["model"]["vocab"]
    names = {i: t for t, i in vocab.items()}
    special = {role: names[meta[f"tokenizer.ggml.{key}"]]
               for role, key in (("bos_token", "bos_token_id"), ("eos_token", "eos_token_id"),
                                 ("unk_token", "unknown_token_id"),
                                 ("pad_token", "padding_token_id"))
               if f"tokenizer.ggml.{key}" in meta}
    add_bos = bool(meta.get("tokenizer.ggml.add_bos_token", False))
    add_eos = bool(meta.get("tokenizer.ggml.add_eos_token", False))
    single = ([{"SpecialToken": {"id": special["bos_token"], "type_id": 0}}] if add_bos else []) \
        + [{"Sequence": {"id": "A", "type_id": 0}}] \
        + ([{"SpecialToken": {"id": special["eos_token"], "type_id": 0}}] if add_eos else [])
    wanted = {
        "normalizer": None,
        "pre_tokenizer": GGUF_PRE_TOKENIZERS[pre](),
        "post_processor": {
            "type": "TemplateProcessing", "single": single,
            "pair": single + [{"Sequence": {"id": "B", "type_id": 1}}],
            "special_tokens": {special[r]: {"id": special[r], "ids": [vocab[special[r]]],
                                            "tokens": [special[r]]}
                               for r, on in (("bos_token", add_bos), ("eos_token", add_eos))
                               if on}},
        "decoder": {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": True,
                    "use_regex": True},
    }
    for key, value in wanted.items():
        if tj.get(key) != value:
            changes.append(f"tokenizer.json {key}: {json.dumps(tj.get(key))[:120]} -> "
                           f"{json.dumps(value)[:120]}")
            tj[key] = value
    Tokenizer.from_str(json.dumps(tj))  # fails here, not at load time, if a field is malformed
    with open(path, "w", encoding="utf-8") as f:
        json.dump(tj, f, ensure_ascii=False, indent=2)

    path = os.path.join(out, "tokenizer_config.json")
    with open(path, encoding="utf-8") as f:
        old = json.load(f)
    # TokenizersBackend loads tokenizer.json as it is; a model-specific class may rebuild parts.
    new = {"tokenizer_class": "TokenizersBackend", "backend": "tokenizers", **special,
           "add_bos_token": add_bos, "add_eos_token": add_eos,
           "clean_up_tokenization_spaces": False}
    if "chat_template" in old:
        new["chat_template"] = old["chat_template"]
    for key in sorted(set(old) | set(new)):
        if key != "chat_template" and old.get(key) != new.get(key):
            changes.append(f"tokenizer_config.json {key}: {old.get(key)!r} -> {new.get(key)!r}")
    with open(path, "w", encoding="utf-8") as f:
        json.dump(new, f, ensure_ascii=False, indent=2)
    return changes


def gemma3_tokenizer(tok, gguf: str):
    """Repairs the tokenizer transformers 5.2 builds from a Gemma 3 GGUF. Its GGUF converter
    makes a Unigram model of the GGUF's scores, but Gemma 3's SentencePiece model is BPE and the
    scores are merge priorities (minus the rank): Unigram then prefers many short pieces
    ("capital" -> " c", "ap", "it", "al") and the model answers nonsense. Here the model is
    replaced by a byte-fallback BPE whose merges come from the scores (transformers'
    generate_merges, as for a SentencePiece BPE file), and <bos> is prepended (the GGUF's
    tokenizer.ggml.add_bos_token): "The capital of France is" -> [2, 818, 5279, 529, 7001, 563],
    the ids of the upstream tokenizer."""
    from gguf import GGUFReader
    from tokenizers.models import BPE
    from transformers.convert_slow_tokenizer import generate_merges
    fields = GGUFReader(gguf).fields
    tokens = [bytes(fields["tokenizer.ggml.tokens"].parts[i]).decode("utf-8")
              for i in fields["tokenizer.ggml.tokens"].data]
    scores = [float(fields["tokenizer.ggml.scores"].parts[i][0])
              for i in fields["tokenizer.ggml.scores"].data]

    def piece(token):  # the same fixes as transformers' GGUFGemmaConverter.vocab
        if token == "<0x09>":
            return "\t"
        if " " in token and not token.strip():
            return "\u2581" * len(token)
        return token
    tokens = [piece(token) for token in tokens]
    vocab = {token: i for i, token in enumerate(tokens)}
    merges = generate_merges(vocab, list(zip(tokens, scores)))
    tok.backend_tokenizer.model = BPE(vocab, merges, unk_token=tok.unk_token or "<unk>",
                                      byte_fallback=True, fuse_unk=True)
    tok.add_bos_token = True
    return tok


def check_tokenizer(out: str) -> None:
    """The saved tokenizer, as AutoTokenizer loads it, round-trips text and adds no BOS."""
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(out)
    for text in ["The capital of France is", " a country that", "247 \n12,  6", "naïve 東京 🚀"]:
        ids = tok.encode(text)
        if tok.decode(ids) != text or ids[0] == tok.bos_token_id:
            raise RuntimeError(f"tokenizer check failed on {text!r}: ids {ids}, "
                               f"decoded {tok.decode(ids)!r}")
    log(f"   tokenizer: {type(tok).__name__}, decoder {tok.backend_tokenizer.decoder}, "
        f"no BOS added; 4 texts round-trip")


def check_gemma3_tokenizer(out: str) -> None:
    """The saved Gemma 3 tokenizer gives the upstream tokenizer's ids (gemma3_tokenizer)."""
    from transformers import AutoTokenizer
    ids = AutoTokenizer.from_pretrained(out).encode("The capital of France is")
    if ids != [2, 818, 5279, 529, 7001, 563]:
        raise RuntimeError(f"Gemma 3 tokenizer check failed: {ids}")
    log("   tokenizer: Gemma 3's BPE, <bos> first; the upstream ids")


def main() -> int:
    gguf, out = sys.argv[1:]
    with open(__file__, "rb") as f:
        source = {"gguf": os.path.basename(gguf), "size": os.path.getsize(gguf),
                  "convert_py_sha256": hashlib.sha256(f.read()).hexdigest()}
    stamp = os.path.join(out, "source.json")
    try:
        with open(stamp) as f:
            if json.load(f) == source:
                log(f"== reusing {out}")
                return 0
    except (OSError, ValueError):
        pass

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, GgufConfig
    folder, name = os.path.split(os.path.abspath(gguf))
    log(f"== converting {name} into {out} (fp32)")
    os.makedirs(out, exist_ok=True)
    fields = gguf_fields(gguf)
    gemma3 = fields.get("general.architecture") == "gemma3"
    tok = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    if gemma3:
        tok = gemma3_tokenizer(tok, gguf)
    # transformers >= 5.1x keeps GGUF weights packed unless asked to dequantize, and refuses to
    # save a model loaded from a GGUF either way (its quantizer stays attached): the dequantized
    # weights go into a plain model built from the same config, which saves as usual.
    gguf_model = AutoModelForCausalLM.from_pretrained(
        folder, gguf_file=name, dtype=torch.float32,
        quantization_config=GgufConfig(dequantize=True))
    config = gguf_model.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    missing, unexpected = model.load_state_dict(gguf_model.state_dict(), strict=False)
    # lm_head is tied to the embeddings when the GGUF has no output tensor
    if unexpected or set(missing) - {"lm_head.weight"}:
        raise RuntimeError(f"state dict mismatch: missing {missing}, unexpected {unexpected}")
    model.tie_weights()
    model.save_pretrained(out)
    tok.save_pretrained(out)
    # The saved folder must compute what the GGUF model computes (tied lm_head included).
    saved = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    ids = torch.tensor([tok.encode("The capital of France is")])
    with torch.no_grad():
        diff = (saved(ids).logits - gguf_model.eval()(ids).logits).abs().max().item()
    if diff != 0.0:
        raise RuntimeError(f"saved model's logits differ from the GGUF model's by {diff}")
    log("   saved model: logits equal to the GGUF model's (max |diff| 0)")
    if gemma3:
        check_gemma3_tokenizer(out)
    else:
        for line in repair_tokenizer(out, fields):
            log("   repaired " + line)
        check_tokenizer(out)
    with open(stamp, "w") as f:
        json.dump(source, f)
    return 0


if __name__ == "__main__":
    sys.exit(main())
