"""Triton Python-backend adapter for the voice pipeline (logic: egomem.identity.voice, .service)."""

import triton_python_backend_utils as pb_utils

from egomem.config import load_config
from egomem.identity.service import VOICE_INPUTS, VOICE_OUTPUTS, voice_request
from egomem.identity.voice import build_speaker_encoder
from egomem.serving.adapter import check_model_config, optional_input


class TritonPythonModel:
    def initialize(self, args):
        check_model_config(args, inputs=VOICE_INPUTS, outputs=VOICE_OUTPUTS)
        self.encoder = build_speaker_encoder(load_config().identity)

    def execute(self, requests):
        responses = []
        for request in requests:
            try:
                pcm = pb_utils.get_input_tensor_by_name(request, "PCM").as_numpy()
                out = voice_request(self.encoder, pcm, optional_input(request, "SAMPLE_RATE"))
                tensors = [pb_utils.Tensor(name, value) for name, value in out.items()]
                responses.append(pb_utils.InferenceResponse(output_tensors=tensors))
            except Exception as e:  # noqa: BLE001 - one bad request must not fail the batch
                responses.append(pb_utils.InferenceResponse(output_tensors=[], error=pb_utils.TritonError(str(e))))
        return responses

    def finalize(self):
        self.encoder = None
