"""Triton Python-backend adapter for the streaming Mimi codec (logic: egomem.codec.mimi; the execute/cohort/
error plumbing: egomem.serving.adapter.SequenceBatchedModel; tensors: egomem.serving.wire)."""

import numpy as np

from egomem.codec.mimi import FRAME_SAMPLES, CodecRequest, MimiStreamPool, build_mimi, serve_codec_batch
from egomem.config import load_config
from egomem.serving import wire
from egomem.serving.adapter import SequenceBatchedModel, cohort_input, optional_input


class TritonPythonModel(SequenceBatchedModel):
    INPUTS, OUTPUTS = wire.TENSORS[wire.MIMI_CODEC]
    ITEM = CodecRequest

    def load(self, device):
        cfg = load_config().mimi
        self.pool = MimiStreamPool(build_mimi(cfg, device), cfg.max_streams, cfg.stream_ttl_s)

    def keys(self, r):
        """The stream state a row touches: its encoder and/or decoder (both when it carries no data: START/END
        reset or free both). An encode and a decode of one stream may share a step; two encodes may not."""
        keys = [(r.stream, "encoder")] * (r.pcm is not None) + [(r.stream, "decoder")] * (r.codes is not None)
        return keys or [(r.stream, "encoder"), (r.stream, "decoder")]

    def parse(self, request, stream, start, end):
        return CodecRequest(stream, start, end, optional_input(request, "PCM", batch_of_one=True),
                            optional_input(request, "CODES_IN", batch_of_one=True))

    def parse_cohort(self, request, streams, flags):
        pcm = cohort_input(request, "COHORT_PCM", streams.size, (FRAME_SAMPLES,))
        codes = cohort_input(request, "COHORT_CODES_IN", streams.size, (self.pool.num_codebooks,))
        return [CodecRequest(stream, start, end, None if pcm is None else pcm[r], None if codes is None else codes[r])
                for r, stream, start, end in self.rows(streams, flags)]

    def serve(self, items):
        return serve_codec_batch(self.pool, items)

    def blank(self, n):
        k = self.pool.num_codebooks
        return {"CODES": np.full((n, k), -1, np.int64), "AUDIO": np.zeros((n, FRAME_SAMPLES), np.float32)}

    def values(self, res):
        return {"CODES": res.codes, "AUDIO": res.pcm}
