"""The capture's manifest names its engine: the vLLM version (GET /version, the stand-in's too),
the model's revision (a hub snapshot's commit) and its chat template's hash (the model's folder
on this node); and consumers of one run whose engines differ make no second capture: the one
whose manifest is not the output's is refused at its pre-flight, naming both."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest

from genqueue.common.capture import parse_capture
from genqueue.common.contracts import ExitCode
from genqueue.common.features import FeatureReader, LocalFeatureStore
from genqueue.consumer.answer.faults import BadCaptureError
from genqueue.consumer.capture.facts import EngineFacts, EngineFactsReader, model_folder, revision_of, template_hash
from genqueue.consumer.capture.features import manifest_for, other_capture
from genqueue.consumer.sim.engine import SIM_VERSION
from tests.conftest import free_port
from tests.consumer.e2e import Sim
from tests.consumer.test_capture_e2e import _consumer, _enqueue, _sim

CAPTURE = parse_capture("hidden-states", "2,4", None)


def sha16(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def test_a_hub_snapshot_names_its_revision_and_a_folder_its_template(tmp_path: Path,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    hub = tmp_path / "hub"
    monkeypatch.setenv("HF_HUB_CACHE", str(hub))
    commit = "0123456789abcdef0123456789abcdef01234567"
    repo = hub / "models--org--m"
    snap = repo / "snapshots" / commit
    snap.mkdir(parents=True)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(commit + "\n")
    (snap / "tokenizer_config.json").write_text(json.dumps({"chat_template": "{{ messages }}"}))
    for root in ("org/m", str(snap)):  # a hub id, or the snapshot folder vLLM reports as its root
        folder = model_folder(root)
        assert (folder, revision_of(folder), template_hash(folder)) == (snap, commit, sha16("{{ messages }}"))
    plain = tmp_path / "plain"
    plain.mkdir()
    (plain / "chat_template.jinja").write_text("{{ x }}")
    (plain / "tokenizer_config.json").write_text(json.dumps({"chat_template": "ignored: the .jinja file wins"}))
    assert (revision_of(model_folder(str(plain))), template_hash(plain)) == ("", sha16("{{ x }}"))
    named = tmp_path / "named"
    named.mkdir()
    templates = [{"name": "default", "template": "a"}, {"name": "tool_use", "template": "b"}]
    (named / "tokenizer_config.json").write_text(json.dumps({"chat_template": templates}))
    assert template_hash(named) == sha16(json.dumps(templates, sort_keys=True))
    assert model_folder("org/absent") is None and model_folder("tiny") is None
    assert (revision_of(None), template_hash(None), template_hash(tmp_path)) == ("", "", "")


def test_the_reader_asks_the_engine_its_version(tmp_path: Path) -> None:
    sim = Sim(tmp_path)
    try:
        facts = EngineFactsReader(sim.url).of("sim")
    finally:
        sim.stop()
    assert facts == EngineFacts(SIM_VERSION, "", "")  # its root names no folder on this node
    with pytest.raises(BadCaptureError, match="version could not be read"):
        EngineFactsReader(f"http://127.0.0.1:{free_port()}/v1", timeout=2).of("sim")


def test_a_manifest_of_other_engine_facts_is_another_capture(tmp_path: Path) -> None:
    assert CAPTURE is not None
    out = tmp_path / "out"
    mine = EngineFacts("0.32.0", "r1", "t1")
    assert other_capture(str(out), "run", CAPTURE, "m", mine) is None  # nothing stored yet
    LocalFeatureStore(out).put_manifest("run", manifest_for(CAPTURE, "m", 32, mine))
    assert other_capture(str(out), "run", CAPTURE, "m", mine) is None
    for other in (EngineFacts("0.33.0", "r1", "t1"), EngineFacts("0.32.0", "r2", "t1"), EngineFacts("0.32.0", "r1", "t2")):
        why = other_capture(str(out), "run", CAPTURE, "m", other)
        assert why is not None and "holds another capture" in why and "\n" not in why, why
    assert manifest_for(CAPTURE, "m", 32, mine).digest != manifest_for(CAPTURE, "m", 32, EngineFacts()).digest


@pytest.mark.integration
def test_a_consumer_whose_engine_differs_from_the_runs_capture_is_refused_at_pre_flight(
        tmp_path: Path, redis_url: str) -> None:
    assert CAPTURE is not None
    out = tmp_path / "out"
    _enqueue(tmp_path, redis_url, "cap", 4, str(out))
    sim = _sim(tmp_path)
    try:
        c = _consumer(tmp_path, redis_url, sim, "cap", "first")
        assert c.wait(120) == ExitCode.DONE, c.output()
        manifest = FeatureReader(LocalFeatureStore(out), "cap").manifest
        assert (manifest.vllm_version, manifest.revision, manifest.chat_template_hash) == (SIM_VERSION, "", "")

        # the same run's output, its capture made by another engine release
        _enqueue(tmp_path, redis_url, "cap2", 4, str(out))
        older = EngineFacts("0.31.0", "", "")
        LocalFeatureStore(out).put_manifest("cap2", manifest_for(CAPTURE, "sim", manifest.hidden_size, older))
        c = _consumer(tmp_path, redis_url, sim, "cap2", "second")
        assert c.wait(120) == ExitCode.PREFLIGHT, c.output()
        lines = [line for line in c.output().splitlines() if "pre-flight failed" in line]
        assert len(lines) == 1 and "holds another capture" in lines[0] and '"vllm_version":"0.31.0"' in lines[0] \
            and f'"vllm_version":"{SIM_VERSION}"' in lines[0], c.output()
        assert not LocalFeatureStore(out).list_shards("cap2"), "no row of the refused consumer was stored"
    finally:
        sim.stop()
