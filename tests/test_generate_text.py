"""Text prompts and end of sequence as transformers reads them (jaxpar.inference.generate, jaxpar.export,
jaxpar.data.text), against transformers itself.

A tiny random LlamaForCausalLM (test_hf.make_hf_model) is saved next to a tiny Llama-3-shaped
`tokenizers` file made here: a word-level vocabulary whose template puts <|begin_of_text|> first, the
header / <|eot_id|> special tokens and a Llama-3-style chat template, saved with transformers'
PreTrainedTokenizerFast.save_pretrained (nothing downloaded).
"""

import dataclasses
import json
import shutil

import numpy as np
import pytest

from conftest import require

torch = require("torch")
transformers = require("transformers")
tokenizers = require("tokenizers")

from jaxpar import export  # noqa: E402
from jaxpar.inference import generate as gen  # noqa: E402
from test_hf import make_hf_model  # noqa: E402

SPECIALS = ["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"]
WORDS = ["<unk>", *SPECIALS, "user", "assistant", *[f"w{i}" for i in range(128 - 8)]]  # vocabulary 128, the model's
TEXT = "w5 w17 w99 w3 w42"
NEW = 12
CHAT = ("{{ bos_token }}{% for message in messages %}{{ '<|start_header_id|>' + message['role'] + "
        "'<|end_header_id|>\n\n' + message['content'] | trim + '<|eot_id|>' }}{% endfor %}"
        "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}")


def make_tokenizer(directory, chat_template=CHAT):
    vocab = {w: i for i, w in enumerate(WORDS)}
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    tok.add_special_tokens([tokenizers.AddedToken(t, special=True) for t in SPECIALS])
    bos = "<|begin_of_text|>"
    tok.post_processor = tokenizers.processors.TemplateProcessing(single=f"{bos} $A", pair=f"{bos} $A {bos} $B",
                                                                  special_tokens=[(bos, vocab[bos])])
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=bos, eos_token="<|end_of_text|>",
                                                unk_token="<unk>")
    if chat_template:
        fast.chat_template = chat_template
    fast.save_pretrained(directory)
    return transformers.PreTrainedTokenizerFast.from_pretrained(directory)


@pytest.fixture
def hf_dir(tmp_path):
    directory = tmp_path / "hf"
    make_hf_model(directory, "gqa")
    return directory


def hf_generate(directory, prompt_ids, new=NEW):
    """transformers' greedy continuation, stopping where its generation config says."""
    model = transformers.LlamaForCausalLM.from_pretrained(directory).eval()
    with torch.no_grad():
        ids = torch.tensor([prompt_ids])
        out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=new,
                             pad_token_id=0)
    return out[0, len(prompt_ids):].tolist()


def jaxpar_generate(capsys, *argv):
    capsys.readouterr()
    assert gen.main([*map(str, argv), "--max_new_tokens", str(NEW), "--json"]) == 0
    return json.loads(capsys.readouterr().out.strip().splitlines()[-1])


def test_a_text_prompt_is_encoded_with_the_tokenizers_bos(hf_dir, capsys):
    """`generate --prompt TEXT` continues what transformers' generate(**tokenizer(TEXT)) continues."""
    tokenizer = make_tokenizer(hf_dir)
    encoded = tokenizer(TEXT, return_tensors="pt")
    assert encoded["input_ids"][0, 0].item() == WORDS.index("<|begin_of_text|>")
    model = transformers.LlamaForCausalLM.from_pretrained(hf_dir).eval()
    with torch.no_grad():
        expected = model.generate(**encoded, do_sample=False, max_new_tokens=NEW, pad_token_id=0)
    out = jaxpar_generate(capsys, "--from_hf", hf_dir, "--prompt", TEXT)
    assert out["prompt_ids"] == encoded["input_ids"][0].tolist()
    assert out["new_ids"] == expected[0, encoded["input_ids"].shape[1]:].tolist()


def first_new_token(ids, after=2):
    """(index, id) of the first token at or after `after` that the continuation has not made before."""
    k = next(k for k in range(after, len(ids)) if ids[k] not in ids[:k])
    return k, ids[k]


@pytest.mark.parametrize("where", ["generation_config.json", "config.json"])
def test_generation_stops_at_any_of_the_eos_ids(hf_dir, capsys, where):
    """An eos list whose second id is one the greedy continuation makes (Llama-3-Instruct's <|eot_id|>
    after <|end_of_text|>): transformers stops there, and so must jaxpar. In generation_config.json it
    wins over config.json's eos (transformers reads that file first); without it, config.json's list."""
    prompt = [1, 5, 17, 99, 3, 42]
    (hf_dir / "generation_config.json").unlink()
    full = hf_generate(hf_dir, prompt)
    assert len(full) == NEW  # config.json's eos (2) is not made: nothing stops it yet
    k, stop = first_new_token(full)
    never = next(i for i in range(3, 128) if i not in full)
    path = hf_dir / where
    path.write_text(json.dumps({**(json.loads(path.read_text()) if path.is_file() else {}),
                                "eos_token_id": [never, stop]}))
    assert hf_generate(hf_dir, prompt) == full[:k + 1]
    out = jaxpar_generate(capsys, "--from_hf", hf_dir, "--prompt_ids", ",".join(map(str, prompt)))
    assert out["new_ids"] == full[:k + 1]


@pytest.mark.parametrize("where", ["chat_template.jinja", "tokenizer_config.json"])
def test_chat_applies_the_tokenizers_chat_template(hf_dir, capsys, where):
    """--chat: the prompt ids of transformers' apply_chat_template(add_generation_prompt=True), from
    either file transformers reads the template from, and its greedy continuation."""
    make_tokenizer(hf_dir)
    if where == "tokenizer_config.json":  # the layout of tokenizers saved before transformers 4.47
        config = json.loads((hf_dir / "tokenizer_config.json").read_text())
        config["chat_template"] = (hf_dir / "chat_template.jinja").read_text()
        (hf_dir / "tokenizer_config.json").write_text(json.dumps(config))
        (hf_dir / "chat_template.jinja").unlink()
    tokenizer = transformers.PreTrainedTokenizerFast.from_pretrained(hf_dir)
    expected = tokenizer.apply_chat_template([{"role": "user", "content": TEXT}], add_generation_prompt=True,
                                             return_dict=True)["input_ids"]
    assert expected[:3] == [WORDS.index(t) for t in ("<|begin_of_text|>", "<|start_header_id|>", "user")]
    assert expected.count(WORDS.index("<|begin_of_text|>")) == 1  # the template's BOS, not the tokenizer's too
    out = jaxpar_generate(capsys, "--from_hf", hf_dir, "--prompt", TEXT, "--chat")
    assert out["prompt_ids"] == expected
    assert out["new_ids"] == hf_generate(hf_dir, expected)


def test_chat_without_a_template_is_a_one_line_error(hf_dir, capsys):
    make_tokenizer(hf_dir, chat_template=None)
    assert not (hf_dir / "chat_template.jinja").exists()
    assert "chat_template" not in json.loads((hf_dir / "tokenizer_config.json").read_text())
    assert gen.main(["--from_hf", str(hf_dir), "--prompt", TEXT, "--chat"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and f"--chat: {hf_dir} has no chat template" in err[0]
    assert gen.main(["--from_hf", str(hf_dir), "--prompt_ids", "1,2", "--chat"]) == 2
    assert "--chat wraps --prompt TEXT" in capsys.readouterr().err


def prepare(tmp_path, tokenizer_file):
    from jaxpar.data.text import prepare_text

    rng = np.random.default_rng(0)
    source = tmp_path / "text"
    source.mkdir()
    for i in range(8):
        (source / f"doc{i}.txt").write_text(" ".join(f"w{j}" for j in rng.integers(0, 40, 60)))
    return prepare_text(source, tmp_path / "data" / "train", tmp_path / "data" / "heldout", str(tokenizer_file),
                        heldout_fraction=0.3)


def test_training_text_gets_bos_as_prompts_do(hf_dir, tmp_path):
    """Each document is encoded as the tokenizer means it (BOS first, as the model was pretrained and
    as generation encodes prompts), then the end-of-document id; a split prepared before meta.json
    said so keeps encoding without special tokens, as its shards were."""
    from jaxpar.data.text import split_tokenizer

    tokenizer = make_tokenizer(hf_dir)
    meta = prepare(tmp_path, hf_dir / "tokenizer.json")["train"]
    bos, eos = WORDS.index("<|begin_of_text|>"), WORDS.index("<|end_of_text|>")
    assert meta["special_tokens"] is True and meta["eos_id"] == eos
    tokens = np.load(tmp_path / "data" / "train" / "tokens_00000.npy")
    starts = np.flatnonzero(tokens == bos)
    assert starts[0] == 0 and len(starts) == meta["files"] == np.sum(tokens == eos)
    np.testing.assert_array_equal(tokens[starts[1:] - 1], eos)
    assert split_tokenizer(tmp_path / "data" / "train").encode(TEXT).tolist() == tokenizer(TEXT)["input_ids"]
    path = tmp_path / "data" / "train" / "meta.json"
    path.write_text(json.dumps({k: v for k, v in json.loads(path.read_text()).items() if k != "special_tokens"}))
    assert split_tokenizer(tmp_path / "data" / "train").encode(TEXT).tolist() == tokenizer(TEXT)["input_ids"][1:]


def test_a_run_stops_at_its_models_eos_ids_and_exports_them(hf_dir, tmp_path, capsys):
    """A run fine-tuned from a Hugging Face Llama on text tokenized with that model's tokenizer ends its
    sequences as the model does: at any of the model's eos ids (an Instruct model's <|eot_id|>), both in
    `generate --workdir` and in the export's generation_config.json, which transformers reads."""
    from jaxpar.config import Config, DataConfig, InitConfig, TrainConfig, validate
    from jaxpar.interop.hf_llama import with_model_from_hf
    from jaxpar.training.loop import train
    from jaxpar.parallel.mesh import Layout

    make_tokenizer(hf_dir)
    prepare(tmp_path, hf_dir / "tokenizer.json")
    config = with_model_from_hf(Config(train=TrainConfig(global_batch_size=2, seq_len=16, steps=2, lr=1e-2),
                                       init=InitConfig(from_hf=str(hf_dir)),
                                       data=DataConfig(train=str(tmp_path / "data" / "train"), eval="",
                                                       generate=False)))
    validate(config)
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "config.json").write_text(json.dumps(dataclasses.asdict(config)))
    train(config, Layout.for_config(config).make_mesh(), run_dir, show_progress=False)

    assert export.main(["--workdir", str(run_dir), "--out", str(tmp_path / "out")]) == 0
    (tmp_path / "out" / "generation_config.json").unlink()  # its full greedy continuation, nothing stopping it
    prompt = transformers.PreTrainedTokenizerFast.from_pretrained(tmp_path / "out")(TEXT)["input_ids"]
    full = hf_generate(tmp_path / "out", prompt)
    eos = WORDS.index("<|end_of_text|>")
    assert eos not in full and len(full) == NEW
    k, stop = first_new_token(full)
    (hf_dir / "generation_config.json").write_text(json.dumps({"eos_token_id": [eos, stop]}))

    out = jaxpar_generate(capsys, "--workdir", run_dir, "--prompt", TEXT)
    assert out["prompt_ids"] == prompt and out["new_ids"] == full[:k + 1]
    shutil.rmtree(tmp_path / "out")
    assert export.main(["--workdir", str(run_dir), "--out", str(tmp_path / "out")]) == 0
    assert json.loads((tmp_path / "out" / "generation_config.json").read_text())["eos_token_id"] == [eos, stop]
    assert (tmp_path / "out" / "chat_template.jinja").read_text() == CHAT
    assert hf_generate(tmp_path / "out", prompt) == full[:k + 1]
