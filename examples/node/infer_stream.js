// Usage: node infer_stream.js HOST:PORT "prompt" [image.png] [adapters/name@alias]
// Calls InferenceService.InferStream (server streaming): prints each text delta as a JSON line
// {"delta": "..."} as it arrives, then the final InferResult as {"result": {...}}.
// API key (if the gateway needs one): VALORA_API_KEY. A W3C traceparent in VALORA_TRACEPARENT is
// sent as metadata, so the gateway's trace continues the caller's.
const path = require('path');
const fs = require('fs');
const grpc = require('@grpc/grpc-js');
const protoLoader = require('@grpc/proto-loader');

const PROTO_ROOT = path.resolve(__dirname, '../../protos');
const definition = protoLoader.loadSync('valora/v1/inference_service.proto', {
  includeDirs: [PROTO_ROOT],
  keepCase: true,
  longs: String,
  enums: String,
  defaults: true,
  oneofs: true,
});
const valora = grpc.loadPackageDefinition(definition).valora.v1;

const [address, prompt, imagePath, adapter] = process.argv.slice(2);
if (!address) {
  console.error('usage: node infer_stream.js HOST:PORT "prompt" [image.png] [adapters/name]');
  process.exit(2);
}
const client = new valora.InferenceService(address, grpc.credentials.createInsecure());
const metadata = new grpc.Metadata();
if (process.env.VALORA_API_KEY) metadata.set('authorization', `Bearer ${process.env.VALORA_API_KEY}`);
if (process.env.VALORA_TRACEPARENT) metadata.set('traceparent', process.env.VALORA_TRACEPARENT);

const input = {
  prompt: prompt || '',
  images: imagePath ? [{ data: fs.readFileSync(imagePath), mime_type: 'image/png' }] : [],
  output_kind: 'OUTPUT_KIND_TEXT',
  params: { max_new_tokens: 8 },
};
if (adapter) input.adapter = adapter;

const deadline = new Date(Date.now() + 60000);
const call = client.InferStream({ input, request_id: `node-stream-${Date.now()}` }, metadata, { deadline });
call.on('data', (msg) => {
  if (msg.text_delta) console.log(JSON.stringify({ delta: msg.text_delta }));
  if (msg.result) console.log(JSON.stringify({ result: msg.result }));
});
call.on('error', (err) => {
  console.error(JSON.stringify({ code: err.code, details: err.details }));
  process.exit(1);
});
call.on('end', () => client.close());
