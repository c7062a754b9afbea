"""Triton Python-backend adapter for the face pipeline (logic: egomem.identity.face, .service)."""

import triton_python_backend_utils as pb_utils

from egomem.config import load_config
from egomem.identity.face import build_face_encoder
from egomem.identity.service import FACE_INPUTS, FACE_OUTPUTS, face_request
from egomem.serving.adapter import check_model_config


class TritonPythonModel:
    def initialize(self, args):
        check_model_config(args, inputs=FACE_INPUTS, outputs=FACE_OUTPUTS)
        self.encoder = build_face_encoder(load_config().identity)  # dlib runs on the CPU either way

    def execute(self, requests):
        responses = []
        for request in requests:
            try:
                image = pb_utils.get_input_tensor_by_name(request, "IMAGE").as_numpy()
                out = face_request(self.encoder, image)
                tensors = [pb_utils.Tensor(name, value) for name, value in out.items()]
                responses.append(pb_utils.InferenceResponse(output_tensors=tensors))
            except Exception as e:  # noqa: BLE001 - one bad request must not fail the batch
                responses.append(pb_utils.InferenceResponse(output_tensors=[], error=pb_utils.TritonError(str(e))))
        return responses

    def finalize(self):
        self.encoder = None
