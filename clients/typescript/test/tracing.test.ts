// The calls' trace metadata, against a fake gRPC server that records what it is sent.
import assert from "node:assert/strict";
import http2 from "node:http2";
import type { AddressInfo } from "node:net";
import { after, before, describe, test } from "node:test";
import { fromBinary } from "@bufbuild/protobuf";
import { context, createTraceState, trace } from "@opentelemetry/api";
import { AsyncLocalStorageContextManager } from "@opentelemetry/context-async-hooks";
import { EnqueueRequestSchema, type EnqueueRequest } from "../src/gen/outbox/v1/outbox_pb.js";
import { Outbox } from "../src/index.js";

const traceId = "4bf92f3577b34da6a3ce929d0e0e4736";
const spanId = "00f067aa0ba902b7";

/** An h2c server that answers every call with an empty message and records its headers and Enqueue request. */
class FakeOutboxd {
  readonly calls: { path: string; headers: http2.IncomingHttpHeaders; request: EnqueueRequest }[] = [];
  private readonly server = http2.createServer();

  async start(): Promise<string> {
    this.server.on("stream", (stream, headers) => {
      const chunks: Buffer[] = [];
      stream.on("data", (chunk: Buffer) => chunks.push(chunk));
      stream.on("end", () => {
        // One gRPC frame: a flag byte, a 4-byte length, the message.
        const request = fromBinary(EnqueueRequestSchema, Buffer.concat(chunks).subarray(5));
        this.calls.push({ path: String(headers[":path"]), headers, request });
        stream.respond({ ":status": 200, "content-type": "application/grpc" }, { waitForTrailers: true });
        stream.on("wantTrailers", () => stream.sendTrailers({ "grpc-status": "0" }));
        stream.end(Buffer.alloc(5)); // an empty EnqueueResponse
      });
    });
    await new Promise<void>((resolve) => this.server.listen(0, "127.0.0.1", resolve));
    return `127.0.0.1:${(this.server.address() as AddressInfo).port}`;
  }

  stop(): Promise<void> {
    return new Promise((resolve) => this.server.close(() => resolve()));
  }
}

describe("trace metadata", () => {
  const fake = new FakeOutboxd();
  let outbox: Outbox;
  before(async () => {
    context.setGlobalContextManager(new AsyncLocalStorageContextManager().enable());
    outbox = new Outbox({ endpoints: [await fake.start()], apiKey: "obx_test" });
  });
  after(async () => {
    outbox?.close();
    await fake.stop();
    context.disable();
  });

  test("an Enqueue inside a span sends it as traceparent and tracestate; outside any, neither", async () => {
    const span = trace.setSpanContext(context.active(), {
      traceId,
      spanId,
      traceFlags: 1,
      traceState: createTraceState("vendor=opaque"),
    });
    assert.deepEqual(await context.with(span, () => outbox.enqueueDirect({ kind: "traced", payload: "{}" })), []);
    assert.deepEqual(await outbox.enqueueDirect({ kind: "untraced", payload: "{}" }), []);

    const [inside, outside] = fake.calls;
    assert.ok(inside && outside);
    assert.equal(inside.path, "/outbox.v1.OutboxService/Enqueue");
    assert.equal(inside.headers["traceparent"], `00-${traceId}-${spanId}-01`);
    assert.equal(inside.headers["tracestate"], "vendor=opaque");
    assert.equal(inside.headers["authorization"], "Bearer obx_test");
    // The intent's header carries the same context, for the worker's handler span.
    assert.equal(inside.request.intents[0]?.headers["traceparent"], `00-${traceId}-${spanId}-01`);
    assert.equal(outside.headers["traceparent"], undefined);
    assert.equal(outside.headers["tracestate"], undefined);
    assert.equal(outside.headers["authorization"], "Bearer obx_test");
  });
});
