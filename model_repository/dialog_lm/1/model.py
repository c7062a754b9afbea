"""Triton Python-backend adapter for the dialog engine (logic: egomem.dialog.serving; the execute/cohort/
error plumbing: egomem.serving.adapter.SequenceBatchedModel; tensors: egomem.serving.wire)."""

import numpy as np

from egomem.config import load_config
from egomem.dialog.serving import DialogRequest, DialogStreamPool, build_engine
from egomem.serving import wire
from egomem.serving.adapter import SequenceBatchedModel, cohort_input, optional_input, text_of


class TritonPythonModel(SequenceBatchedModel):
    INPUTS, OUTPUTS = wire.TENSORS[wire.DIALOG_LM]
    ITEM = DialogRequest

    def load(self, device):
        cfg = load_config().dialog
        engine, tokenizer = build_engine(cfg, device)
        self.pool = DialogStreamPool(engine, tokenizer, cfg.stream_ttl_s, seed=cfg.seed)
        self.n_listen, self.dep_q = engine.lm.num_codebooks - engine.lm.dep_q - 1, engine.lm.dep_q

    def parse(self, request, stream, start, end):
        r = DialogRequest(stream, start, end, optional_input(request, "LISTEN_CODES", batch_of_one=True))
        level = optional_input(request, "MEMCHUNK_LEVEL", batch_of_one=True)
        r.memchunk_level = None if level is None else int(level.reshape(-1)[0])
        r.memchunk_tokens = optional_input(request, "MEMCHUNK_TOKENS", batch_of_one=True)
        text = optional_input(request, "MEMCHUNK_TEXT", batch_of_one=True)
        r.memchunk_text = None if text is None else text_of(text.reshape(-1)[0])
        return r

    def parse_cohort(self, request, streams, flags):
        """A row's MemChunk refresh: COHORT_MEMCHUNK_LEVEL 1/2 (0 = none) and its COHORT_MEMCHUNK_TEXT."""
        listen, level, text = (cohort_input(request, wire.cohort(name), streams.size, shape) for name, shape in
                               (("LISTEN_CODES", (self.n_listen,)), ("MEMCHUNK_LEVEL", ()), ("MEMCHUNK_TEXT", ())))
        if (level is None) != (text is None):
            raise ValueError("COHORT_MEMCHUNK_LEVEL and COHORT_MEMCHUNK_TEXT go together")
        out = []
        for r, stream, start, end in self.rows(streams, flags):
            out.append(DialogRequest(stream, start, end, None if listen is None else listen[r]))
            if level is not None and int(level[r]) != 0:
                out[-1].memchunk_level, out[-1].memchunk_text = int(level[r]), text_of(text[r])
        return out

    def blank(self, n):
        return {"TEXT_TOKEN": np.full(n, -1, np.int64), "SPEAK_CODES": np.full((n, self.dep_q), -1, np.int64),
                "TEXT_PIECE": np.full(n, b"", np.object_), "STEP": np.zeros(n, np.int64)}

    def values(self, r):
        return dict(TEXT_TOKEN=r.text_token, SPEAK_CODES=r.speak_codes, TEXT_PIECE=r.text_piece.encode(), STEP=r.step)
