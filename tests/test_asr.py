"""The speech recognisers of the user's channel (`egomem.memory.asr`) on real LibriSpeech speech,
bad input, the OpenAI-compatible backend against a local server, the local-Whisper path errors,
and a memory job whose user spoke but sent no transcript line."""

from __future__ import annotations

import io
import json
import os
import re
import socket
from pathlib import Path

import numpy as np
import pytest
import soundfile as sf
from llm_server import FakeOpenAIServer

from egomem.config import load_config
from egomem.memory.asr import (
    AsrInputError,
    AsrUnavailable,
    OpenAIRecogniser,
    PocketSphinxRecogniser,
    WhisperRecogniser,
    check_audio,
    make_recogniser,
    resample,
    word_errors,
)
from egomem.memory.chunk import StreamChunk
from egomem.memory.segment import spans_to_labels
from egomem.memory.sqlite import SQLiteMemoryStore
from egomem.memory.transcribe import Transcriber
from egomem.memory.worker import build_manager
from tests.memory_helpers import ColumnLabeler

DATA = Path(__file__).parent / "data" / "asr"
REFS = dict(line.split(" ", 1) for line in (DATA / "test-other.trans.txt").read_text().splitlines() if line.strip())
WER_BOUND = 0.50  # PocketSphinx's en-us model scores 0.41 on these test-other utterances (bench/bench_asr.py)


def librispeech(utt: str, rate: int = 24000) -> np.ndarray:
    """The utterance as the memory job records it: float32 at `rate` (the orchestrator keeps 24 kHz)."""
    x, sr = sf.read(DATA / f"{utt}.flac", dtype="float32")
    assert sr == 16000
    return resample(x, sr, rate)


@pytest.fixture(scope="module")
def sphinx() -> PocketSphinxRecogniser:
    return PocketSphinxRecogniser()


@pytest.fixture()
def server():
    srv = FakeOpenAIServer().start()
    yield srv
    srv.stop()


def test_the_pocketsphinx_wheel_ships_its_english_model(sphinx):
    m = sphinx.model_dir / "en-us"
    assert (m / "en-us" / "mdef").stat().st_size > 1e6  # acoustic model
    assert (m / "en-us.lm.bin").stat().st_size > 1e7  # 3-gram language model
    assert "thornton" in (m / "cmudict-en-us.dict").read_text()  # pronouncing dictionary


def test_pocketsphinx_transcribes_librispeech_at_24khz_within_the_wer_bound(sphinx):
    errors = words = 0
    hyps = {}
    for utt, ref in REFS.items():
        hyps[utt] = sphinx.recognise(librispeech(utt), 24000)
        e, n = word_errors(ref, hyps[utt])
        errors, words = errors + e, words + n
    wer = errors / words
    assert wer < WER_BOUND, (wer, hyps)
    assert {"blood", "steel"} <= set(hyps["1688-142285-0000"].split())
    assert {"hale", "thornton", "anxiety"} <= set(hyps["1688-142285-0001"].split())


def test_24khz_and_16khz_input_give_the_same_words_and_silence_gives_none(sphinx):
    utt = "1688-142285-0002"
    assert sphinx.recognise(librispeech(utt, 24000), 24000) == sphinx.recognise(librispeech(utt, 16000), 16000)
    assert sphinx.recognise(np.zeros(24000 * 3, np.float32), 24000) == ""
    assert sphinx.recognise(np.zeros(0, np.float32), 24000) == ""  # empty: "" by rule, backend not called


def test_speech_running_to_the_end_is_decoded_and_long_regions_are_cut(sphinx):
    from egomem.memory.asr import speech_regions, to_int16

    x = librispeech("1688-142285-0001", 16000)[:480 * 250]  # 7.5 s: ends mid-sentence on a VAD frame boundary
    segs = sphinx.segments(x, 16000)
    assert segs and segs[-1][1] == pytest.approx(7.5, abs=0.05) and "hale" in segs[0][2]
    regions = speech_regions(to_int16(x).tobytes(), max_s=2.0)
    assert len(regions) >= 3 and all(len(r[2]) <= 2 * 16000 * 2 + 2 * 960 for r in regions)
    assert all(a[1] <= b[0] + 1e-6 for a, b in zip(regions, regions[1:]))  # in order, no overlap


@pytest.mark.parametrize("rate", [0, -24000, 100, 1_000_000, 24000.0, None, True])
def test_an_impossible_sample_rate_is_refused_naming_it(sphinx, rate):
    with pytest.raises(AsrInputError, match=r"sample rate .*expected an integer number of Hz"):
        sphinx.recognise(np.zeros(2400, np.float32), rate)


def test_nan_stereo_and_integer_audio_are_refused_with_the_reason(sphinx):
    x = np.zeros(2400, np.float32)
    x[7] = np.nan
    with pytest.raises(AsrInputError, match="1 NaN/inf samples"):
        sphinx.recognise(x, 24000)
    with pytest.raises(AsrInputError, match=r"shape \(2, 2400\): expected mono"):
        check_audio(np.zeros((2, 2400), np.float32), 24000)
    with pytest.raises(AsrInputError, match="dtype int16: expected float PCM"):
        check_audio(np.zeros(2400, np.int16), 24000)
    assert check_audio(np.full((1, 4), 3.0), 16000).tolist() == [1.0] * 4  # [1, S] -> [S], clipped


def test_the_transcriber_skips_refused_audio_and_keeps_the_monologue(sphinx):
    x = np.full(24000, np.nan, np.float32)
    t = Transcriber(recogniser=sphinx).transcribe(x, 24000, [], [(3, "hello there")])
    assert t.source == "client+monologue" and t.text == "ASSISTANT (inner monologue): hello there"


def test_client_lines_win_and_the_recogniser_fills_sessions_without_them(sphinx):
    audio = librispeech("1688-142285-0002")
    tr = Transcriber(recogniser=sphinx)
    with_client = tr.transcribe(audio, 24000, [(4, "You don't mean that you thought me so silly?")], [])
    assert with_client.source == "client+monologue"
    assert with_client.text == "USER (client transcript): You don't mean that you thought me so silly?"
    heard = tr.transcribe(audio, 24000, [], [(2, "Hmm.")])
    assert heard.source == "asr:pocketsphinx"
    user, assistant = heard.text.splitlines()
    assert user.startswith("USER (asr:pocketsphinx): ") and "silly" in user and assistant.endswith("Hmm.")
    assert Transcriber(recogniser=None).transcribe(audio, 24000, [], []).text == ""


def test_config_picks_the_backend_and_none_means_no_recogniser():
    cfg = load_config(env={})
    assert cfg.asr.backend == "pocketsphinx" and isinstance(make_recogniser(cfg.asr), PocketSphinxRecogniser)
    cfg = load_config(env={"EGOMEM__ASR__BACKEND": '"none"'})
    assert make_recogniser(cfg.asr) is None and not Transcriber(cfg.asr, cfg.llm).uses_asr


def test_whisper_without_a_local_model_fails_naming_the_path(tmp_path):
    with pytest.raises(AsrUnavailable, match="needs asr.whisper_path"):
        WhisperRecogniser(None)
    missing = tmp_path / "whisper-small"
    with pytest.raises(AsrUnavailable, match=re.escape(str(missing)) + " does not exist"):
        WhisperRecogniser(missing)
    missing.mkdir()
    with pytest.raises(AsrUnavailable, match=re.escape(str(missing / "model.bin"))):
        WhisperRecogniser(missing)  # neither layout
    (missing / "config.json").write_text(json.dumps({"model_type": "whisper"}))
    with pytest.raises(AsrUnavailable, match=re.escape(str(missing / "model.safetensors"))):
        WhisperRecogniser(missing)  # transformers layout without weights
    ct2 = tmp_path / "faster-whisper-tiny"
    ct2.mkdir()
    (ct2 / "model.bin").write_bytes(b"\0")
    with pytest.raises(AsrUnavailable, match=re.escape(str(ct2 / "config.json"))):
        WhisperRecogniser(ct2)
    cfg = load_config(env={"EGOMEM__ASR__BACKEND": '"whisper"', "EGOMEM__ASR__WHISPER_PATH": f'"{tmp_path / "nope"}"'})
    with pytest.raises(AsrUnavailable, match=re.escape(str(tmp_path / "nope"))):
        make_recogniser(cfg.asr)


def tiny_whisper_folder(out: Path, says: str = "a") -> Path:
    """A transformers Whisper folder made here (no download): random tiny weights, byte-level tokenizer,
    and the last layer norm / output projection set so every step emits the byte `says` (a known answer)."""
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import (
        GenerationConfig,
        WhisperConfig,
        WhisperFeatureExtractor,
        WhisperForConditionalGeneration,
        WhisperProcessor,
        WhisperTokenizerFast,
    )
    from transformers.models.gpt2.tokenization_gpt2 import bytes_to_unicode

    out.mkdir(parents=True)
    vocab = {c: i for i, c in enumerate(bytes_to_unicode().values())}
    specials = ["<|endoftext|>", "<|startoftranscript|>", "<|en|>", "<|translate|>", "<|transcribe|>",
                "<|notimestamps|>"]
    tk = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tk.pre_tokenizer, tk.decoder = pre_tokenizers.ByteLevel(add_prefix_space=False), decoders.ByteLevel()
    tk.add_special_tokens(specials)
    tk.save(str(out / "tokenizer.json"))
    eot = "<|endoftext|>"
    tok = WhisperTokenizerFast(tokenizer_file=str(out / "tokenizer.json"), unk_token=eot, bos_token=eot,
                               eos_token=eot, pad_token=eot)
    ids = {t: tok.convert_tokens_to_ids(t) for t in specials}
    WhisperProcessor(feature_extractor=WhisperFeatureExtractor(feature_size=80), tokenizer=tok).save_pretrained(out)
    torch.manual_seed(0)
    common = dict(decoder_start_token_id=ids["<|startoftranscript|>"], eos_token_id=ids[eot], pad_token_id=ids[eot],
                  bos_token_id=ids[eot], begin_suppress_tokens=None, suppress_tokens=None)
    m = WhisperForConditionalGeneration(WhisperConfig(
        vocab_size=len(tok), num_mel_bins=80, d_model=32, encoder_layers=1, decoder_layers=1, encoder_attention_heads=2,
        decoder_attention_heads=2, encoder_ffn_dim=64, decoder_ffn_dim=64, max_source_positions=1500,
        max_target_positions=32, **common))
    with torch.no_grad():  # hidden state = b whatever the input; logits = W b: only `says` scores
        b = torch.randn(32)
        m.model.decoder.layer_norm.weight.zero_()
        m.model.decoder.layer_norm.bias.copy_(b)
        m.proj_out.weight.zero_()
        m.proj_out.weight[vocab[says]] = 10 * b / b.dot(b)
    m.generation_config = GenerationConfig(
        max_length=10, is_multilingual=True, lang_to_id={"<|en|>": ids["<|en|>"]},
        task_to_id={"transcribe": ids["<|transcribe|>"], "translate": ids["<|translate|>"]},
        no_timestamps_token_id=ids["<|notimestamps|>"], forced_decoder_ids=None, **common)
    m.save_pretrained(out)
    return out


def test_a_transformers_whisper_folder_runs_offline_window_by_window(tmp_path, monkeypatch):
    folder = tiny_whisper_folder(tmp_path / "whisper-tiny-test")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    rec = WhisperRecogniser(folder)
    assert rec.kind == "transformers" and rec.name == "whisper:whisper-tiny-test"
    noise = 0.1 * np.random.default_rng(0).standard_normal(40 * 24000).astype(np.float32)
    words = rec.recognise(noise, 24000).split()
    assert len(words) == 2 and set(words[0]) == {"a"} == set(words[1])  # 40 s = two 30-s windows
    (folder / "model.safetensors").unlink()
    with pytest.raises(AsrUnavailable, match=re.escape(str(folder / "model.safetensors"))):
        WhisperRecogniser(folder)


@pytest.mark.skipif(not os.environ.get("EGOMEM_TEST_WHISPER_PATH"),
                    reason="optional backend: set $EGOMEM_TEST_WHISPER_PATH to a local faster-whisper or "
                           "transformers Whisper folder (nothing is downloaded)")
def test_a_local_whisper_model_transcribes_librispeech():
    rec = WhisperRecogniser(os.environ["EGOMEM_TEST_WHISPER_PATH"])
    e, n = word_errors(REFS["1688-142285-0001"], rec.recognise(librispeech("1688-142285-0001"), 24000))
    assert e / n < 0.25  # faster-whisper-base: 3 errors in 34 words here


def test_doctor_says_which_recogniser_runs(tmp_path):
    from egomem.doctor import check_asr

    (f,) = check_asr(load_config(env={}))
    assert f.level == "ok" and "pocketsphinx (offline" in f.what
    (f,) = check_asr(load_config(env={"EGOMEM__ASR__BACKEND": '"whisper"',
                                      "EGOMEM__ASR__WHISPER_PATH": f'"{tmp_path / "w"}"'}))
    assert f.level == "fail" and str(tmp_path / "w") in f.fix
    (f,) = check_asr(load_config(env={"EGOMEM__ASR__BACKEND": '"none"'}))
    assert f.level == "note" and "pocketsphinx" in f.fix


def test_openai_backend_uploads_16khz_wav_to_the_endpoint(server):
    cfg = load_config(env={})
    cfg.asr.backend, cfg.asr.base_url, cfg.asr.model = "openai", server.base_url, "whisper-large-v3"
    server.transcript_text = "  I live in Oslo.  "
    rec = make_recogniser(cfg.asr, cfg.llm)
    assert isinstance(rec, OpenAIRecogniser) and rec.name == "whisper-large-v3"
    assert rec.recognise(librispeech("1688-142285-0002"), 24000) == "I live in Oslo."
    wav, sr = sf.read(io.BytesIO(server.transcription_files[0]), dtype="float32")
    assert sr == 16000 and wav.ndim == 1 and len(wav) == sf.info(DATA / "1688-142285-0002.flac").frames
    assert server.transcriptions[0]["model"] == "whisper-large-v3" and server.transcription_languages == ["en"]
    assert rec.recognise(np.zeros(0, np.float32), 24000) == "" and len(server.transcription_files) == 1


def test_openai_backend_with_a_dead_endpoint_says_so():
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cfg = load_config(env={})
    cfg.asr.backend, cfg.asr.base_url = "openai", f"http://127.0.0.1:{port}/v1"
    cfg.asr.timeout_s, cfg.asr.max_attempts = 2.0, 1
    with pytest.raises(AsrUnavailable, match=rf"127\.0\.0\.1:{port}/v1 unreachable.*asr\.backend = 'pocketsphinx'"):
        make_recogniser(cfg.asr, cfg.llm).recognise(np.zeros(2400, np.float32), 24000)
    cfg.asr.base_url = None
    with pytest.raises(AsrUnavailable, match="needs asr.base_url"):
        make_recogniser(cfg.asr, cfg.llm)


def _extract_from_user_lines(req: dict) -> dict:
    """A stand-in LLM: reports who the USER lines mention (Mister Thornton), nothing else."""
    transcript = req["messages"][1]["content"]
    user = " ".join(ln for ln in transcript.splitlines() if ln.startswith("USER"))
    out = {"summary": "", "name": None, "facts": [], "preferences": [], "persona": [], "relations": []}
    if "thornton" in user.lower():
        out["facts"] = [{"key": "knows", "text": "knows Mister Thornton"}]
        out["relations"] = [{"person": "Thornton", "relation": "acquaintance"}]
    return out


@pytest.mark.parametrize("backend", ["pocketsphinx", "none"])
def test_a_memory_job_with_user_audio_and_no_client_line_gets_user_facts_from_the_recogniser(
        server, tmp_path, monkeypatch, backend):
    monkeypatch.setenv("EGOMEM_TEST_LLM_KEY", "k")
    server.responder = _extract_from_user_lines
    cfg = load_config(env={})
    cfg.llm.base_url, cfg.llm.model, cfg.llm.api_key_env = server.base_url, "fake-model", "EGOMEM_TEST_LLM_KEY"
    cfg.llm.timeout_s, cfg.llm.backoff_base_s = 5.0, 0.01
    cfg.memory.database, cfg.memory.chunk_dir, cfg.memory.extractor = tmp_path / "m.db", tmp_path / "chunks", "llm"
    cfg.asr.backend = backend
    speech = librispeech("1688-142285-0001")  # "... when Mister Thornton made his confession ..."
    T = 200  # 16 s; the user speaks from step 10
    audio = np.zeros(T * 1920, np.float32)
    audio[10 * 1920:10 * 1920 + speech.size] = speech
    tokens = np.random.default_rng(0).integers(0, 2048, size=(T, 17))
    tokens[:, 0] = spans_to_labels([(5, 190)], T)  # ColumnLabeler: one session, steps 5..190
    chunk = StreamChunk("s-asr", 0, 1000.0, tokens, monologue=[(8, "Tell me more.")], listen_audio=audio)
    store = SQLiteMemoryStore(cfg.memory.database)
    (out,) = build_manager(cfg, store, labeler=ColumnLabeler()).process_chunk(chunk)
    if backend == "none":  # the control: without a recogniser the user's words never reach memory
        assert out.user_id is None and "USER" not in server.requests[0]["messages"][1]["content"]
        return
    session = store.get_session(out.session_id)
    assert session.transcript_source == "asr:pocketsphinx"
    assert re.search(r"^USER \(asr:pocketsphinx\): .*\bthornton\b", session.transcript, re.M)
    assert out.new_user and [f.text for f in store.facts(out.user_id)] == ["knows Mister Thornton"]
    assert [(r.relation, name) for r, name in store.relations(out.user_id)] == [("acquaintance", "Thornton")]
