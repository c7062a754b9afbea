"""Triton Python-backend adapter for the voice pipeline (logic: egomem.identity.voice, .service)."""

import triton_python_backend_utils as pb_utils

from egomem.config import load_config
from egomem.identity.service import VOICE_INPUTS, VOICE_OUTPUTS, voice_request
from egomem.identity.voice import build_speaker_encoder
from egomem.serving.adapter import check_model_config, optional_input, respond_each


class TritonPythonModel:
    def initialize(self, args):
        check_model_config(args, inputs=VOICE_INPUTS, outputs=VOICE_OUTPUTS)
        self.encoder = build_speaker_encoder(load_config().identity)

    def execute(self, requests):
        return respond_each(requests, lambda r: voice_request(
            self.encoder, pb_utils.get_input_tensor_by_name(r, "PCM").as_numpy(), optional_input(r, "SAMPLE_RATE")))

    def finalize(self):
        self.encoder = None
