"""Triton's streaming infer (`ModelStreamInfer`): requests and responses on one gRPC stream,
as tritonclient's `start_stream` / `async_stream_infer` and Triton's LLM backends use it.

Each request on the stream is answered in order:
- a language model's generation (cuvild/serve/generation.py): a request to a model that
  generates, with `text_input` (BYTES, with the entry's tokenizer) or `input_ids` (INT64)
  and no `cache_position`, gets one response per token (`output_ids` [1] INT64, and
  `text_output` [1] BYTES with a tokenizer), as Triton's decoupled models answer; options are
  request parameters (max_tokens, temperature, top_k, top_p, seed), as
  `async_stream_infer(..., parameters={"max_tokens": 32})` sends them. The last response
  says `triton_final_response: true`; with `enable_empty_final_response` it is an empty one
  after the last token;
- any other request (a sequence step too) gets the one response `ModelInfer` gives.
A request's failure is its response's `error_message` (the stream goes on), as Triton's.
"""

from __future__ import annotations

import struct
from collections.abc import Iterator
from typing import Any

import grpc
import numpy as np

from cuvild.core.errors import InferError
from cuvild.core.layout import BadInput
from cuvild.serve.errors import Refused
from cuvild.serve.generation import OPTIONS
from cuvild.serve.regions import RegionError
from protos import inference_pb2 as pb

FINAL = "triton_final_response"
EMPTY_FINAL = "triton_enable_empty_final_response"
PROMPTS = ("text_input", "input_ids")


class StreamInfer:
    """ModelStreamInfer for InferenceService (cuvild/serve/oip.py), which it is mixed into:
    `_find`, `_infer`, `gate` and `generator` are the service's."""

    generator: Any = None  # cuvild/serve/generation.py Generator (None: no generation)

    def ModelStreamInfer(self, requests: Iterator[Any],  # noqa: N802
                         context: grpc.ServicerContext) -> Iterator[Any]:
        for request in requests:
            try:
                with self.gate.enter(context):  # type: ignore[attr-defined]
                    yield from self._stream_one(request, context)
            except (Refused, RegionError, BadInput, InferError) as e:
                yield pb.ModelStreamInferResponse(error_message=str(e))

    def _stream_one(self, request: Any, context: grpc.ServicerContext) -> Iterator[Any]:
        served = self._find(request.model_name, request.model_version)  # type: ignore[attr-defined]
        empty_final = bool(request.parameters[EMPTY_FINAL].bool_param) \
            if EMPTY_FINAL in request.parameters else False
        names = {t.name for t in request.inputs}
        if (self.generator is not None and served.loaded is not None
                and served.loaded.state is not None and names & set(PROMPTS)
                and "cache_position" not in names):
            yield from self._generate(served, request, empty_final)
            return
        response, _ = self._infer(served, request, context, None, 0, 0)  # type: ignore[attr-defined]
        response.parameters[FINAL].bool_param = True
        yield pb.ModelStreamInferResponse(infer_response=response)

    def _generate(self, served: Any, request: Any, empty_final: bool) -> Iterator[Any]:
        prompt, text = _prompt(request)
        options = {k: _param_value(request.parameters[k]) for k in OPTIONS
                   if k in request.parameters}
        gen = self.generator.open(served.record.name, served.record.version, prompt=prompt,
                                  text=text, options=options)
        last = None
        tokens = gen.tokens()
        try:
            for token, piece in tokens:
                if last is not None:
                    yield pb.ModelStreamInferResponse(infer_response=last)
                last = _token(served, request, token, piece if gen.tokenizer else None)
        finally:
            tokens.close()  # type: ignore[attr-defined]
        if empty_final or last is None:
            if last is not None:
                yield pb.ModelStreamInferResponse(infer_response=last)
            last = pb.ModelInferResponse(model_name=served.record.name,
                                         model_version=served.record.version, id=request.id)
        last.parameters[FINAL].bool_param = True
        yield pb.ModelStreamInferResponse(infer_response=last)


def _prompt(request: Any) -> tuple[list[int] | None, str | None]:
    """The request's prompt: token ids (input_ids, INT64) or text (text_input, BYTES)."""
    raw = list(request.raw_input_contents)
    for i, tensor in enumerate(request.inputs):
        data = raw[i] if i < len(raw) else None
        if tensor.name == "input_ids":
            if tensor.datatype != "INT64":
                raise BadInput(f"input_ids must be INT64, got {tensor.datatype}")
            ids = (np.frombuffer(data, np.int64).tolist() if data is not None
                   else list(tensor.contents.int64_contents))
            return [int(t) for t in ids], None
        if tensor.name == "text_input":
            if tensor.datatype != "BYTES":
                raise BadInput(f"text_input must be BYTES, got {tensor.datatype}")
            if data is not None:
                if len(data) < 4:
                    raise BadInput("text_input: no length prefix")
                (size,) = struct.unpack_from("<I", data)
                text = data[4:4 + size]
            elif tensor.contents.bytes_contents:
                text = tensor.contents.bytes_contents[0]
            else:
                raise BadInput("text_input has no contents")
            return None, bytes(text).decode("utf-8", errors="replace")
    raise BadInput(f"a generation request needs one of {list(PROMPTS)}")


def _param_value(param: Any) -> Any:
    which = param.WhichOneof("parameter_choice")
    return getattr(param, which) if which else None


def _token(served: Any, request: Any, token: int, piece: str | None) -> Any:
    """One token's response: output_ids [1] (and text_output [1] with a tokenizer)."""
    response = pb.ModelInferResponse(model_name=served.record.name,
                                     model_version=served.record.version, id=request.id)
    response.outputs.add(name="output_ids", datatype="INT64", shape=[1])
    response.raw_output_contents.append(np.array([token], np.int64).tobytes())
    if piece is not None:
        data = piece.encode()
        response.outputs.add(name="text_output", datatype="BYTES", shape=[1])
        response.raw_output_contents.append(struct.pack("<I", len(data)) + data)
    return response
