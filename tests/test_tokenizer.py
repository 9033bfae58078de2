"""prime_rl.tokenizer: AutoTokenizer's pick of class, recorded per local folder, gives the same
tokenizer on the next load without importing AutoTokenizer or torch."""

import json
import os
import shutil
import subprocess
import sys

from prime_rl import tokenizer as tok

from helpers import REPO

# In a fresh interpreter: load, then report what was imported and what the tokenizer gives.
PROBE = """
import json, sys
from prime_rl.chat import PROBE_CHAT
from prime_rl.tokenizer import load_tokenizer
t = load_tokenizer(sys.argv[1])
print(json.dumps({
    "class": type(t).__module__ + "." + type(t).__qualname__,
    "torch": "torch" in sys.modules,
    "auto": "transformers.models.auto.tokenization_auto" in sys.modules,
    "ids": t.apply_chat_template(PROBE_CHAT, add_generation_prompt=True, tokenize=True)["input_ids"],
    "plain": t("<|im_end|> x", add_special_tokens=False)["input_ids"],
    "special": [t.eos_token, t.pad_token, t.bos_token, sorted(t.all_special_tokens)],
    "vocab": len(t),
}))
"""


def probe(model, cache) -> dict:
    done = subprocess.run([sys.executable, "-c", PROBE, str(model)], cwd=REPO, capture_output=True, text=True,
                          env={**os.environ, "PRIME_RL_CACHE": str(cache)}, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    return json.loads(done.stdout.splitlines()[-1])


def test_the_second_load_gives_autotokenizers_tokenizer_without_importing_torch(tiny_model, tmp_path):
    cache = tmp_path / "cache"
    first = probe(tiny_model, cache)
    assert first["auto"] and first["torch"]  # asked AutoTokenizer (which imports torch)
    records = list((cache / "tokenizers").glob("*.json"))
    assert len(records) == 1
    second = probe(tiny_model, cache)
    assert not second["auto"] and not second["torch"]
    assert {k: v for k, v in second.items() if k not in ("auto", "torch")} == \
        {k: v for k, v in first.items() if k not in ("auto", "torch")}


def test_the_key_covers_what_autotokenizer_reads(tiny_model, tmp_path):
    model = tmp_path / "m"
    shutil.copytree(tiny_model, model)
    key = tok.choice_key(str(model), model)
    assert tok.choice_key(str(model), model) == key
    assert tok.choice_key(str(model) + "/", model) != key  # AutoTokenizer matches patterns on the name
    config = json.loads((model / "tokenizer_config.json").read_text())
    (model / "tokenizer_config.json").write_text(json.dumps({**config, "tokenizer_class": "Qwen2Tokenizer"}))
    changed = tok.choice_key(str(model), model)
    assert changed != key
    (model / "tekken.json").write_text("{}")  # a file's presence alone picks a backend
    assert tok.choice_key(str(model), model) != changed
    (model / "tekken.json").unlink()
    (model / "config.json").write_text((model / "config.json").read_text().replace('"qwen3"', '"llama"'))
    assert tok.choice_key(str(model), model) != changed


def test_an_unusable_record_is_asked_again_and_rewritten(tiny_model, tmp_path, monkeypatch):
    monkeypatch.setenv("PRIME_RL_CACHE", str(tmp_path))
    record = tok.classes_dir() / f"{tok.choice_key(str(tiny_model), tiny_model)}.json"
    record.parent.mkdir(parents=True)
    for bad in ("not json", json.dumps({"module": "os", "class": "system"}),
                json.dumps({"module": "transformers", "class": "NoSuchTokenizer"}), json.dumps({"module": 3})):
        record.write_text(bad)
        assert tok.recorded_class(record) is None
    loaded = tok.load_tokenizer(str(tiny_model))
    assert tok.recorded_class(record) is type(loaded)
    assert list(record.parent.iterdir()) == [record]  # no temporary file left


def test_only_transformers_classes_are_recorded(tmp_path):
    record = tmp_path / "r.json"

    class Local:
        @classmethod
        def from_pretrained(cls, name):
            return cls()

    tok.record_class(record, Local)  # a model's own code (or this test's) is asked for every time
    assert not record.exists()
