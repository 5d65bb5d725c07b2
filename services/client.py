"""A Python client for the public gRPC API, and `eagle2 client`.

    from services.client import Eagle2Client
    with Eagle2Client("localhost:9000") as c:
        print(c.generate("Hello!", max_tokens=32).text)
        for delta in c.stream("Tell me a story"):
            print(delta.text_delta, end="")
"""

from __future__ import annotations

import json
import sys

import grpc

from services.protos import eagle2_pb2, eagle2_pb2_grpc


class Eagle2Client:
    def __init__(self, address: str = "localhost:9000", application: str = "eagle2",
                 timeout_s: float = 600.0, api_key: str | None = None,
                 root_certificates: bytes | None = None):
        """api_key: sent as `authorization: Bearer <key>`; root_certificates: PEM of the CA
        of a TLS terminator in front of the service (then the channel is TLS)."""
        if root_certificates is not None:
            creds = grpc.ssl_channel_credentials(root_certificates=root_certificates)
            self.channel = grpc.secure_channel(address, creds)
        else:
            self.channel = grpc.insecure_channel(address)
        self.stub = eagle2_pb2_grpc.Eagle2Stub(self.channel)
        self.metadata = (("application", application),) + (
            (("authorization", f"Bearer {api_key}"),) if api_key else ())
        self.timeout_s = timeout_s

    def __enter__(self) -> Eagle2Client:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        self.channel.close()

    @staticmethod
    def request(prompt: str | list[dict] | list[int], **kw) -> eagle2_pb2.GenerateRequest:
        """kw: max_tokens, temperature, top_p, top_k, seed, stop, mode, raw, request_id,
        logprobs (each token's log-probability and that many most likely tokens')."""
        req = eagle2_pb2.GenerateRequest(**kw)
        if isinstance(prompt, str):
            req.text = prompt
        elif prompt and isinstance(prompt[0], dict):
            req.chat.messages.extend(eagle2_pb2.ChatMessage(**m) for m in prompt)
        else:
            req.token_ids.ids.extend(prompt)
        return req

    def generate(self, prompt, **kw) -> eagle2_pb2.GenerateResponse:
        return self.stub.Generate(self.request(prompt, **kw), metadata=self.metadata,
                                  timeout=self.timeout_s)

    def stream(self, prompt, **kw):
        """Iterator of GenerateStreamResponse; close it (or break) to cancel the request."""
        return self.stub.GenerateStream(self.request(prompt, **kw), metadata=self.metadata,
                                        timeout=self.timeout_s)

    def model_info(self) -> eagle2_pb2.ModelInfoResponse:
        return self.stub.ModelInfo(eagle2_pb2.ModelInfoRequest(), metadata=self.metadata,
                                   timeout=self.timeout_s)


def add_arguments(p) -> None:
    p.add_argument("prompt")
    p.add_argument("--address", default="localhost:9000")
    p.add_argument("--api-key-env", default="EAGLE2_API_KEY",
                   help="environment variable holding the API key to send (if set)")
    p.add_argument("--tls-ca", default=None,
                   help="PEM file of the CA of a TLS terminator in front of the service")
    p.add_argument("--stream", action="store_true")
    p.add_argument("--temperature", type=float, default=None)
    p.add_argument("--top-p", type=float, default=None)
    p.add_argument("--max-tokens", type=int, default=None)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--mode", default="")
    p.add_argument("--json", action="store_true")


def run(args) -> int:
    kw = {k: v for k, v in (("temperature", args.temperature), ("top_p", args.top_p),
                            ("max_tokens", args.max_tokens), ("seed", args.seed)) if v is not None}
    kw["mode"] = args.mode
    try:
        import os

        ca = open(args.tls_ca, "rb").read() if args.tls_ca else None
        with Eagle2Client(args.address, api_key=os.environ.get(args.api_key_env),
                          root_certificates=ca) as c:
            if args.stream:
                text, ids, last = "", [], None
                for msg in c.stream(args.prompt, **kw):
                    text += msg.text_delta
                    ids.extend(msg.token_ids)
                    last = msg
                    if not args.json:
                        print(msg.text_delta, end="", flush=True)
                out = {"text": text, "token_ids": ids, "tau": last.stats.tau if last else 0.0,
                       "finish_reason": eagle2_pb2.FinishReason.Name(last.finish_reason)}
            else:
                r = c.generate(args.prompt, **kw)
                out = {"text": r.text, "token_ids": list(r.token_ids), "tau": r.stats.tau,
                       "finish_reason": eagle2_pb2.FinishReason.Name(r.finish_reason)}
                if not args.json:
                    print(r.text, end="")
    except grpc.RpcError as e:
        print(f"eagle2 client: {e.code().name}: {e.details()}", file=sys.stderr)
        return 1
    if args.json:
        print(json.dumps(out))
    else:
        print()
    return 0
