"""Triton Python-backend adapter for the Level-2 sentence embedder (logic: egomem.retrieval.encoder)."""

import triton_python_backend_utils as pb_utils

from egomem.config import load_config
from egomem.retrieval.encoder import TEXT_INPUTS, TEXT_OUTPUTS, build_text_encoder, text_request
from egomem.serving.adapter import check_model_config


class TritonPythonModel:
    def initialize(self, args):
        check_model_config(args, inputs=TEXT_INPUTS, outputs=TEXT_OUTPUTS)
        self.encoder = build_text_encoder(load_config().retrieval)
        if args.get("model_instance_kind") == "GPU":
            self.encoder.to("cuda")

    def execute(self, requests):
        responses = []
        for request in requests:
            try:
                text = pb_utils.get_input_tensor_by_name(request, "TEXT").as_numpy()
                out = text_request(self.encoder, text)
                tensors = [pb_utils.Tensor(name, value) for name, value in out.items()]
                responses.append(pb_utils.InferenceResponse(output_tensors=tensors))
            except Exception as e:  # noqa: BLE001 - one bad request must not fail the batch
                responses.append(pb_utils.InferenceResponse(output_tensors=[], error=pb_utils.TritonError(str(e))))
        return responses

    def finalize(self):
        self.encoder = None
