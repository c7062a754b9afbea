"""Triton Python-backend adapter for the Level-2 sentence embedder (logic: egomem.retrieval.encoder)."""

import triton_python_backend_utils as pb_utils

from egomem.config import load_config
from egomem.retrieval.encoder import TEXT_INPUTS, TEXT_OUTPUTS, build_text_encoder, text_request
from egomem.serving.adapter import check_model_config, respond_each


class TritonPythonModel:
    def initialize(self, args):
        check_model_config(args, inputs=TEXT_INPUTS, outputs=TEXT_OUTPUTS)
        self.encoder = build_text_encoder(load_config().retrieval)
        if args.get("model_instance_kind") == "GPU":
            self.encoder.to("cuda")

    def execute(self, requests):
        return respond_each(requests, lambda r: text_request(
            self.encoder, pb_utils.get_input_tensor_by_name(r, "TEXT").as_numpy()))

    def finalize(self):
        self.encoder = None
