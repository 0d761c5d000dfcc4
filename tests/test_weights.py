"""`kvpop.train.weights`: a run's trained weights read back from a run directory, a checkpoint or a kvpop.save
directory, and put on a copy of the base model they were trained from."""

import random
from pathlib import Path

import pytest
import torch

import kvpop
from helpers import tiny_model
from kvpop.eval.metrics import policy_priorities
from kvpop.files import FileFormatError
from kvpop.models import load_model
from kvpop.train import checkpoint as ckpt
from kvpop.train import distill
from kvpop.train.distill import TrainConfig
from kvpop.train.weights import model_with, read_weights, source_config

KCFG = dict(sink=2, window=8, topk=16, scorer="mlstm", mlstm_dim=8, match_mlp_memory=True)


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> Path:
    """A finished 4-step scorer-only run that kept its checkpoint of step 2."""
    rng = random.Random(0)
    words = "the cat sat on a mat and then it ran to the big red house where many dogs live".split()
    root = tmp_path_factory.mktemp("weights")
    data = root / "notes.txt"
    data.write_text("\n\n".join(" ".join(rng.choice(words) for _ in range(300)) for _ in range(40)))
    out = root / "run"
    tcfg = TrainConfig(model="tiny-random-qwen3", data=str(data), seq_len=128, steps=4, batch_size=2, out=str(out),
                       save_every=0, keep_every=2, lr_scorer=1e-2, max_tokens=128 * 16, freeze_base=True)
    distill.train(tcfg, kvpop.KVpopConfig(**KCFG), progress=False)
    return out


def test_a_run_its_checkpoints_and_its_final_model_read_back_alike(run):
    last = read_weights(run)
    assert last.path == run / "checkpoints" / "step-00000004" and last.step == 4 and last.run == run
    # a frozen base is not in the checkpoint: the scorers only, at the resolved config (topk less the mLSTM state)
    assert not last.holds_base and last.config.topk < 16 and not last.config.match_mlp_memory
    assert source_config(run) == last.config == source_config(run / "final")
    assert read_weights(run / "checkpoints" / "step-00000002").step == 2
    final = read_weights(run / "final")
    # its final directory holds the scorers only as well (saved without the frozen base)
    assert final.step is None and final.run is None and not final.holds_base
    base, _ = load_model("tiny-random-qwen3")
    ids = torch.randint(0, 250, (1, 64))
    want = policy_priorities(kvpop.load(run / "final"), ids)
    for weights in (last, final):
        model = model_with(base, weights)
        for a, b in zip(policy_priorities(model, ids), want):
            assert torch.equal(a, b)
    assert not hasattr(base, "kvpop"), "the base is left as it is"


def test_what_holds_no_weights_is_a_clear_error(run, tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        read_weights(tmp_path / "nothing")
    with pytest.raises(FileFormatError, match="neither a run directory"):
        read_weights(tmp_path)
    (tmp_path / ckpt.LOG).write_text('{"step": 1}\n')
    with pytest.raises(FileFormatError, match="no complete checkpoint and no final model"):
        read_weights(tmp_path)


def test_weights_go_only_on_the_base_they_were_trained_from(run):
    with pytest.raises(ValueError, match="trained from another base model than the other one"):
        model_with(tiny_model("qwen3", seed=3), read_weights(run), "the other one")
