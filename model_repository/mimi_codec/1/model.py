"""Triton Python-backend adapter for the streaming Mimi codec (logic: egomem.codec.mimi).

A request is either one stream's frame (PCM / CODES_IN, the stream = its correlation id) or a cohort
(COHORT_STREAMS + COHORT_PCM / COHORT_CODES_IN, one row per stream; egomem.serving.adapter). Every row
of every request in one execute() meets in ONE batched encode and ONE batched decode.
"""

import numpy as np
import triton_python_backend_utils as pb_utils

from egomem.codec.mimi import FRAME_SAMPLES, CodecRequest, MimiStreamPool, build_mimi, serve_codec_batch
from egomem.config import load_config
from egomem.serving.adapter import (SEQUENCE_END, SEQUENCE_START, StepBatch, check_model_config, cohort_errors,
                                    cohort_input, cohort_members, error_response, optional_input, sequence_flags)

INPUTS = {"PCM": "TYPE_FP32", "CODES_IN": "TYPE_INT64", "COHORT_STREAMS": "TYPE_INT64", "COHORT_FLAGS": "TYPE_INT32",
          "COHORT_PCM": "TYPE_FP32", "COHORT_CODES_IN": "TYPE_INT64"}
OUTPUTS = {"CODES": "TYPE_INT64", "AUDIO": "TYPE_FP32", "COHORT_CODES": "TYPE_INT64", "COHORT_AUDIO": "TYPE_FP32",
           "COHORT_ERRORS": "TYPE_STRING"}


def _state_keys(r: CodecRequest) -> list[tuple[int, str]]:
    """The stream state a row touches: its encoder and/or decoder (both when it carries no data: START/END
    reset or free both). An encode and a decode of one stream may share a step; two encodes may not."""
    keys = ([(r.stream, "encoder")] if r.pcm is not None else []) + ([(r.stream, "decoder")] if r.codes is not None else [])
    return keys or [(r.stream, "encoder"), (r.stream, "decoder")]


class TritonPythonModel:
    def initialize(self, args):
        check_model_config(args, inputs=INPUTS, outputs=OUTPUTS)
        cfg = load_config().mimi
        device = "cuda" if args.get("model_instance_kind") == "GPU" else "cpu"
        self.pool = MimiStreamPool(build_mimi(cfg, device), cfg.max_streams, cfg.stream_ttl_s)

    def _add_cohort(self, batch: StepBatch, i: int, request, streams: np.ndarray, flags: np.ndarray) -> None:
        k = self.pool.num_codebooks
        pcm = cohort_input(request, "COHORT_PCM", streams.size, (FRAME_SAMPLES,))
        codes = cohort_input(request, "COHORT_CODES_IN", streams.size, (k,))
        for r, (stream, flag) in enumerate(zip(streams.tolist(), flags.tolist())):
            item = CodecRequest(stream, bool(flag & SEQUENCE_START), bool(flag & SEQUENCE_END),
                                None if pcm is None else pcm[r], None if codes is None else codes[r])
            batch.add(i, item, _state_keys(item))

    def execute(self, requests):
        batch, cohorts = StepBatch(), set()
        for i, request in enumerate(requests):
            try:
                members = cohort_members(request)
                if members is not None:
                    cohorts.add(i)
                    self._add_cohort(batch, i, request, *members)
                    continue
            except ValueError as e:
                batch.fail(i, str(e))
                continue
            stream, start, end = sequence_flags(request)
            try:
                pcm = optional_input(request, "PCM", batch_of_one=True)
                codes = optional_input(request, "CODES_IN", batch_of_one=True)
                item = CodecRequest(stream, start, end, pcm, codes)
                batch.add(i, item, _state_keys(item))
            except ValueError as e:
                item = CodecRequest(stream, start, end)
                batch.add(i, item, _state_keys(item), error=str(e))  # END still frees the stream
        results = serve_codec_batch(self.pool, batch.items)
        return [self._respond(batch, i, request, results, i in cohorts) for i, request in enumerate(requests)]

    def _respond(self, batch: StepBatch, i: int, request, results, cohort: bool):
        if i in batch.request_errors:
            return error_response(batch.request_errors[i])
        rows = batch.results_of(i, results)
        wanted = set(request.requested_output_names())
        if cohort:
            k = self.pool.num_codebooks
            codes = np.full((len(rows), k), -1, np.int64)
            audio = np.zeros((len(rows), FRAME_SAMPLES), np.float32)
            for r, (res, _) in enumerate(rows):
                if res is not None and res.codes is not None:
                    codes[r] = res.codes
                if res is not None and res.pcm is not None:
                    audio[r] = res.pcm
            wanted = wanted or {"COHORT_CODES", "COHORT_AUDIO"}
            out = [pb_utils.Tensor("COHORT_ERRORS", cohort_errors(rows))]
            if "COHORT_CODES" in wanted:
                out.append(pb_utils.Tensor("COHORT_CODES", codes[None]))
            if "COHORT_AUDIO" in wanted:
                out.append(pb_utils.Tensor("COHORT_AUDIO", audio[None]))
            return pb_utils.InferenceResponse(output_tensors=out)
        (res, err), = rows
        if err:
            return error_response(err)
        wanted = wanted or {"CODES", "AUDIO"}
        out = []
        if "CODES" in wanted and res.codes is not None:
            out.append(pb_utils.Tensor("CODES", res.codes[None]))
        if "AUDIO" in wanted and res.pcm is not None:
            out.append(pb_utils.Tensor("AUDIO", res.pcm[None]))
        return pb_utils.InferenceResponse(output_tensors=out)

    def finalize(self):
        self.pool = None
