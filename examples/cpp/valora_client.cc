// Usage: valora_client infer|stream HOST:PORT "prompt" [image.png] [adapters/name@alias]
// Calls InferenceService.Infer (prints the InferResult as one JSON line) or InferStream (prints
// each InferStreamResponse as a JSON line: {"text_delta": ...} as text arrives, then
// {"result": {...}}). A failed call prints `CODE: message (REASON)` on stderr, as the Python SDK's
// typed errors and the valora CLI do (REASON: the google.rpc.ErrorInfo of the status details),
// then `  field: description` for each BadRequest field violation, and exits 1. API key (if the gateway needs one): VALORA_API_KEY. A W3C traceparent in
// VALORA_TRACEPARENT is sent as metadata, so the gateway's trace continues the caller's.
// The stubs are generated from ../../protos at build time (see the Makefile).
#include <chrono>
#include <cstdlib>
#include <fstream>
#include <iostream>
#include <iterator>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include <google/protobuf/unknown_field_set.h>
#include <google/protobuf/util/json_util.h>
#include <grpcpp/grpcpp.h>

#include "valora/v1/inference_service.grpc.pb.h"

namespace {

// JSON as the Node example prints it: the protos' own field names, enums by name.
std::string ToJson(const google::protobuf::Message& msg) {
  google::protobuf::util::JsonPrintOptions opts;
  opts.preserve_proto_field_names = true;
  std::string out;
  google::protobuf::util::MessageToJsonString(msg, &out, opts);
  return out;
}

const char* CodeName(grpc::StatusCode code) {
  static const char* names[] = {
      "OK",        "CANCELLED",    "UNKNOWN",  "INVALID_ARGUMENT",   "DEADLINE_EXCEEDED",
      "NOT_FOUND", "ALREADY_EXISTS", "PERMISSION_DENIED", "RESOURCE_EXHAUSTED",
      "FAILED_PRECONDITION", "ABORTED", "OUT_OF_RANGE", "UNIMPLEMENTED", "INTERNAL",
      "UNAVAILABLE", "DATA_LOSS",   "UNAUTHENTICATED"};
  int i = static_cast<int>(code);
  return i >= 0 && i <= 16 ? names[i] : "UNKNOWN";
}

// The length-delimited fields numbered `number` of a serialized message.
std::vector<std::string> Fields(const std::string& bytes, int number) {
  google::protobuf::UnknownFieldSet set;
  std::vector<std::string> out;
  if (!set.ParseFromString(bytes)) return out;
  for (int i = 0; i < set.field_count(); ++i) {
    const auto& f = set.field(i);
    if (f.number() == number && f.type() == google::protobuf::UnknownField::TYPE_LENGTH_DELIMITED)
      out.push_back(f.length_delimited());
  }
  return out;
}

std::string First(const std::string& bytes, int number) {
  auto fields = Fields(bytes, number);
  return fields.empty() ? "" : fields.front();
}

// What the server put in the status details (the grpc-status-details-bin trailer, a serialized
// google.rpc.Status): ErrorInfo.reason and BadRequest's field violations. Debian ships no C++
// classes of google/rpc's protos, so the few fields are read by number: Status.details = 3, each
// an Any (type_url 1, value 2); ErrorInfo.reason = 1; BadRequest.field_violations = 1, each
// {field 1, description 2}. Malformed details read as none.
struct Details {
  std::string reason;
  std::vector<std::pair<std::string, std::string>> violations;
};

Details ReadDetails(const std::string& status_bytes) {
  const std::string prefix = "type.googleapis.com/google.rpc.";
  Details out;
  for (const auto& any : Fields(status_bytes, 3)) {
    std::string type = First(any, 1), value = First(any, 2);
    if (type == prefix + "ErrorInfo") {
      out.reason = First(value, 1);
    } else if (type == prefix + "BadRequest") {
      for (const auto& v : Fields(value, 1)) out.violations.emplace_back(First(v, 1), First(v, 2));
    }
  }
  return out;
}

int Fail(const grpc::Status& status) {
  Details details = ReadDetails(status.error_details());
  std::cerr << CodeName(status.error_code()) << ": " << status.error_message();
  if (!details.reason.empty()) std::cerr << " (" << details.reason << ")";
  std::cerr << "\n";
  for (const auto& [field, description] : details.violations) std::cerr << "  " << field << ": " << description << "\n";
  std::cerr.flush();
  return 1;
}

void Prepare(grpc::ClientContext* ctx) {
  ctx->set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(60));
  if (const char* key = std::getenv("VALORA_API_KEY"); key && *key)
    ctx->AddMetadata("authorization", std::string("Bearer ") + key);
  if (const char* tp = std::getenv("VALORA_TRACEPARENT"); tp && *tp) ctx->AddMetadata("traceparent", tp);
}

}  // namespace

int main(int argc, char** argv) {
  std::string mode = argc > 1 ? argv[1] : "";
  if (argc < 3 || (mode != "infer" && mode != "stream")) {
    std::cerr << "usage: valora_client infer|stream HOST:PORT \"prompt\" [image.png] [adapters/name]\n";
    return 2;
  }
  valora::v1::InferenceInput input;
  input.set_prompt(argc > 3 ? argv[3] : "");
  if (argc > 4 && *argv[4]) {
    std::ifstream f(argv[4], std::ios::binary);
    if (!f) {
      std::cerr << "cannot read " << argv[4] << "\n";
      return 2;
    }
    auto* image = input.add_images();
    image->set_data(std::string(std::istreambuf_iterator<char>(f), {}));
    image->set_mime_type("image/png");
  }
  if (argc > 5 && *argv[5]) input.set_adapter(argv[5]);
  input.set_output_kind(valora::v1::OUTPUT_KIND_TEXT);
  input.mutable_params()->set_max_new_tokens(8);

  auto stub = valora::v1::InferenceService::NewStub(
      grpc::CreateChannel(argv[2], grpc::InsecureChannelCredentials()));
  std::string request_id = "cpp-" + std::to_string(std::chrono::system_clock::now().time_since_epoch().count());
  grpc::ClientContext ctx;
  Prepare(&ctx);

  if (mode == "infer") {
    valora::v1::InferRequest req;
    *req.mutable_input() = input;
    req.set_request_id(request_id);
    valora::v1::InferResponse resp;
    grpc::Status status = stub->Infer(&ctx, req, &resp);
    if (!status.ok()) return Fail(status);
    std::cout << ToJson(resp.result()) << std::endl;
    return 0;
  }
  valora::v1::InferStreamRequest req;
  *req.mutable_input() = input;
  req.set_request_id(request_id);
  auto reader = stub->InferStream(&ctx, req);
  valora::v1::InferStreamResponse msg;
  // One line per message as it arrives (flushed), so a reader sees the tokens stream.
  while (reader->Read(&msg)) std::cout << ToJson(msg) << std::endl;
  grpc::Status status = reader->Finish();
  return status.ok() ? 0 : Fail(status);
}
