// Usage: node infer.js HOST:PORT "prompt" [image.png] [adapters/name@alias]
// Loads valora's public protos at run time and calls InferenceService.Infer.
// Prints the InferResult as JSON. API key (if the gateway needs one): VALORA_API_KEY.
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
  console.error('usage: node infer.js HOST:PORT "prompt" [image.png] [adapters/name]');
  process.exit(2);
}
const client = new valora.InferenceService(address, grpc.credentials.createInsecure());
const metadata = new grpc.Metadata();
if (process.env.VALORA_API_KEY) metadata.set('authorization', `Bearer ${process.env.VALORA_API_KEY}`);

const input = {
  prompt: prompt || '',
  images: imagePath ? [{ data: fs.readFileSync(imagePath), mime_type: 'image/png' }] : [],
  output_kind: 'OUTPUT_KIND_TEXT',
  params: { max_new_tokens: 8 },
};
if (adapter) input.adapter = adapter;

const deadline = new Date(Date.now() + 60000);
client.Infer({ input, request_id: `node-${Date.now()}` }, metadata, { deadline }, (err, response) => {
  if (err) {
    console.error(JSON.stringify({ code: err.code, details: err.details }));
    process.exit(1);
  }
  console.log(JSON.stringify(response.result));
});
