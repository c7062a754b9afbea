"""Triton Python-backend adapter for the dialog engine (logic: egomem.dialog.serving).

A request is either one stream's tick (LISTEN_CODES, the stream = its correlation id) or a cohort
(COHORT_STREAMS + COHORT_LISTEN_CODES, one row per stream; egomem.serving.adapter). Every row of every
request in one execute() is one engine step.
"""

import numpy as np
import triton_python_backend_utils as pb_utils

from egomem.config import load_config
from egomem.dialog.serving import DialogRequest, DialogStreamPool, build_engine
from egomem.serving.adapter import (SEQUENCE_END, SEQUENCE_START, StepBatch, check_model_config, cohort_errors,
                                    cohort_input, cohort_members, error_response, optional_input, sequence_flags)

INPUTS = {"LISTEN_CODES": "TYPE_INT64", "MEMCHUNK_LEVEL": "TYPE_INT32", "MEMCHUNK_TOKENS": "TYPE_INT64",
          "MEMCHUNK_TEXT": "TYPE_STRING", "COHORT_STREAMS": "TYPE_INT64", "COHORT_FLAGS": "TYPE_INT32",
          "COHORT_LISTEN_CODES": "TYPE_INT64", "COHORT_MEMCHUNK_LEVEL": "TYPE_INT32",
          "COHORT_MEMCHUNK_TEXT": "TYPE_STRING"}
OUTPUTS = {"TEXT_TOKEN": "TYPE_INT64", "SPEAK_CODES": "TYPE_INT64", "TEXT_PIECE": "TYPE_STRING", "STEP": "TYPE_INT64",
           "COHORT_TEXT_TOKEN": "TYPE_INT64", "COHORT_SPEAK_CODES": "TYPE_INT64", "COHORT_TEXT_PIECE": "TYPE_STRING",
           "COHORT_STEP": "TYPE_INT64", "COHORT_ERRORS": "TYPE_STRING"}


def _text(raw) -> str:
    return raw.decode("utf-8") if isinstance(raw, bytes) else str(raw)


def _parse(request) -> DialogRequest:
    stream, start, end = sequence_flags(request)
    r = DialogRequest(stream, start, end)
    r.listen = optional_input(request, "LISTEN_CODES", batch_of_one=True)
    level = optional_input(request, "MEMCHUNK_LEVEL", batch_of_one=True)
    r.memchunk_level = None if level is None else int(level.reshape(-1)[0])
    r.memchunk_tokens = optional_input(request, "MEMCHUNK_TOKENS", batch_of_one=True)
    text = optional_input(request, "MEMCHUNK_TEXT", batch_of_one=True)
    if text is not None:
        r.memchunk_text = _text(text.reshape(-1)[0])
    return r


def _parse_cohort(request, streams: np.ndarray, flags: np.ndarray, n_listen: int) -> list[DialogRequest]:
    """One DialogRequest per row; a row's MemChunk refresh: COHORT_MEMCHUNK_LEVEL 1/2 (0 = none) + its text."""
    rows = streams.size
    listen = cohort_input(request, "COHORT_LISTEN_CODES", rows, (n_listen,))
    level = cohort_input(request, "COHORT_MEMCHUNK_LEVEL", rows, ())
    text = cohort_input(request, "COHORT_MEMCHUNK_TEXT", rows, ())
    if (level is None) != (text is None):
        raise ValueError("COHORT_MEMCHUNK_LEVEL and COHORT_MEMCHUNK_TEXT go together")
    out = []
    for r, (stream, flag) in enumerate(zip(streams.tolist(), flags.tolist())):
        d = DialogRequest(stream, bool(flag & SEQUENCE_START), bool(flag & SEQUENCE_END))
        d.listen = None if listen is None else listen[r]
        if level is not None and int(level[r]) != 0:
            d.memchunk_level, d.memchunk_text = int(level[r]), _text(text[r])
        out.append(d)
    return out


class TritonPythonModel:
    def initialize(self, args):
        check_model_config(args, inputs=INPUTS, outputs=OUTPUTS)
        cfg = load_config().dialog
        device = "cuda" if args.get("model_instance_kind") == "GPU" else "cpu"
        engine, tokenizer = build_engine(cfg, device)
        self.pool = DialogStreamPool(engine, tokenizer, cfg.stream_ttl_s)
        lm = engine.lm
        self.n_listen = lm.num_codebooks - lm.dep_q - 1
        self.dep_q = lm.dep_q

    def execute(self, requests):
        batch, cohorts = StepBatch(), set()
        for i, request in enumerate(requests):
            try:
                members = cohort_members(request)
                if members is not None:
                    cohorts.add(i)
                    for d in _parse_cohort(request, *members, self.n_listen):
                        batch.add(i, d, [d.stream])
                    continue
            except (ValueError, UnicodeDecodeError) as e:
                batch.fail(i, str(e))
                continue
            try:
                d = _parse(request)
                batch.add(i, d, [d.stream])
            except (ValueError, UnicodeDecodeError) as e:
                stream, start, end = sequence_flags(request)
                batch.add(i, DialogRequest(stream, start, end), [stream], error=str(e))  # END still frees the slot
        results = self.pool.serve(batch.items)
        return [self._respond(batch, i, results, i in cohorts) for i in range(len(requests))]

    def _respond(self, batch: StepBatch, i: int, results, cohort: bool):
        if i in batch.request_errors:
            return error_response(batch.request_errors[i])
        rows = batch.results_of(i, results)
        if cohort:
            n = len(rows)
            token = np.full((n,), -1, np.int64)
            speak = np.full((n, self.dep_q), -1, np.int64)
            step = np.zeros((n,), np.int64)
            piece = np.array([b""] * n, dtype=np.object_)
            for r, (res, _) in enumerate(rows):
                if res is not None:
                    token[r], speak[r], step[r], piece[r] = res.text_token, res.speak_codes, res.step, \
                        res.text_piece.encode("utf-8")
            return pb_utils.InferenceResponse(output_tensors=[
                pb_utils.Tensor("COHORT_TEXT_TOKEN", token[None]), pb_utils.Tensor("COHORT_SPEAK_CODES", speak[None]),
                pb_utils.Tensor("COHORT_TEXT_PIECE", piece[None]), pb_utils.Tensor("COHORT_STEP", step[None]),
                pb_utils.Tensor("COHORT_ERRORS", cohort_errors(rows))])
        (res, err), = rows
        if err:
            return error_response(err)
        return pb_utils.InferenceResponse(output_tensors=[
            pb_utils.Tensor("TEXT_TOKEN", np.array([[res.text_token]], dtype=np.int64)),
            pb_utils.Tensor("SPEAK_CODES", res.speak_codes.astype(np.int64)[None]),
            pb_utils.Tensor("TEXT_PIECE", np.array([[res.text_piece.encode("utf-8")]], dtype=np.object_)),
            pb_utils.Tensor("STEP", np.array([[res.step]], dtype=np.int64)),
        ])

    def finalize(self):
        self.pool = None
