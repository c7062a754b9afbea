"""Triton Python-backend adapter for the streaming Mimi codec (logic: egomem.codec.mimi)."""

import triton_python_backend_utils as pb_utils

from egomem.codec.mimi import CodecRequest, MimiStreamPool, build_mimi, serve_codec_batch
from egomem.serving.streams import StreamError
from egomem.config import load_config
from egomem.serving.adapter import check_model_config, optional_input, sequence_flags


class TritonPythonModel:
    def initialize(self, args):
        check_model_config(args, inputs={"PCM": "TYPE_FP32", "CODES_IN": "TYPE_INT64"},
                           outputs={"CODES": "TYPE_INT64", "AUDIO": "TYPE_FP32"})
        cfg = load_config().mimi
        device = "cuda" if args.get("model_instance_kind") == "GPU" else "cpu"
        self.pool = MimiStreamPool(build_mimi(cfg, device), cfg.max_streams, cfg.stream_ttl_s)

    def execute(self, requests):
        parsed, errors = [], {}
        for i, request in enumerate(requests):
            stream, start, end = sequence_flags(request)
            try:
                pcm = optional_input(request, "PCM", batch_of_one=True)
                codes = optional_input(request, "CODES_IN", batch_of_one=True)
            except ValueError as e:
                errors[i] = str(e)
                pcm = codes = None
            parsed.append(CodecRequest(stream, start, end, pcm, codes))
        results = serve_codec_batch(self.pool, parsed)
        responses = []
        for i, (request, res) in enumerate(zip(requests, results)):
            if i in errors or isinstance(res, StreamError):
                msg = errors.get(i) or str(res)
                responses.append(pb_utils.InferenceResponse(output_tensors=[], error=pb_utils.TritonError(msg)))
                continue
            wanted = set(request.requested_output_names()) or {"CODES", "AUDIO"}
            out = []
            if "CODES" in wanted and res.codes is not None:
                out.append(pb_utils.Tensor("CODES", res.codes[None]))
            if "AUDIO" in wanted and res.pcm is not None:
                out.append(pb_utils.Tensor("AUDIO", res.pcm[None]))
            responses.append(pb_utils.InferenceResponse(output_tensors=out))
        return responses

    def finalize(self):
        self.pool = None
