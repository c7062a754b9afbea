"""Triton Python-backend adapter for the face pipeline (logic: egomem.identity.face, .service)."""

import triton_python_backend_utils as pb_utils

from egomem.config import load_config
from egomem.identity.face import build_face_encoder
from egomem.identity.service import FACE_INPUTS, FACE_OUTPUTS, face_request
from egomem.serving.adapter import check_model_config, respond_each


class TritonPythonModel:
    def initialize(self, args):
        check_model_config(args, inputs=FACE_INPUTS, outputs=FACE_OUTPUTS)
        self.encoder = build_face_encoder(load_config().identity)  # dlib runs on the CPU either way

    def execute(self, requests):
        return respond_each(requests, lambda r: face_request(
            self.encoder, pb_utils.get_input_tensor_by_name(r, "IMAGE").as_numpy()))

    def finalize(self):
        self.encoder = None
