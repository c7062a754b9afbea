"""Triton Python-backend adapter for the dialog engine (logic: egomem.dialog.serving)."""

import numpy as np
import triton_python_backend_utils as pb_utils

from egomem.config import load_config
from egomem.dialog.serving import DialogRequest, DialogStreamPool, build_engine
from egomem.serving.streams import StreamError
from egomem.serving.adapter import check_model_config, optional_input, sequence_flags

INPUTS = {"LISTEN_CODES": "TYPE_INT64", "MEMCHUNK_LEVEL": "TYPE_INT32", "MEMCHUNK_TOKENS": "TYPE_INT64",
          "MEMCHUNK_TEXT": "TYPE_STRING"}
OUTPUTS = {"TEXT_TOKEN": "TYPE_INT64", "SPEAK_CODES": "TYPE_INT64", "TEXT_PIECE": "TYPE_STRING", "STEP": "TYPE_INT64"}


def _parse(request) -> DialogRequest:
    stream, start, end = sequence_flags(request)
    r = DialogRequest(stream, start, end)
    r.listen = optional_input(request, "LISTEN_CODES", batch_of_one=True)
    level = optional_input(request, "MEMCHUNK_LEVEL", batch_of_one=True)
    r.memchunk_level = None if level is None else int(level.reshape(-1)[0])
    r.memchunk_tokens = optional_input(request, "MEMCHUNK_TOKENS", batch_of_one=True)
    text = optional_input(request, "MEMCHUNK_TEXT", batch_of_one=True)
    if text is not None:
        raw = text.reshape(-1)[0]
        r.memchunk_text = raw.decode("utf-8") if isinstance(raw, bytes) else str(raw)
    return r


class TritonPythonModel:
    def initialize(self, args):
        check_model_config(args, inputs=INPUTS, outputs=OUTPUTS)
        cfg = load_config().dialog
        device = "cuda" if args.get("model_instance_kind") == "GPU" else "cpu"
        engine, tokenizer = build_engine(cfg, device)
        self.pool = DialogStreamPool(engine, tokenizer, cfg.stream_ttl_s)

    def execute(self, requests):
        parsed, errors = [], {}
        for i, request in enumerate(requests):
            try:
                parsed.append(_parse(request))
            except (ValueError, UnicodeDecodeError) as e:
                errors[i] = str(e)
                stream, start, end = sequence_flags(request)
                parsed.append(DialogRequest(stream, start, end))  # END still frees the slot
        results = self.pool.serve(parsed)
        responses = []
        for i, res in enumerate(results):
            if i in errors or isinstance(res, StreamError):
                err = pb_utils.TritonError(errors.get(i) or str(res))
                responses.append(pb_utils.InferenceResponse(output_tensors=[], error=err))
                continue
            responses.append(pb_utils.InferenceResponse(output_tensors=[
                pb_utils.Tensor("TEXT_TOKEN", np.array([[res.text_token]], dtype=np.int64)),
                pb_utils.Tensor("SPEAK_CODES", res.speak_codes.astype(np.int64)[None]),
                pb_utils.Tensor("TEXT_PIECE", np.array([[res.text_piece.encode("utf-8")]], dtype=np.object_)),
                pb_utils.Tensor("STEP", np.array([[res.step]], dtype=np.int64)),
            ]))
        return responses

    def finalize(self):
        self.pool = None
