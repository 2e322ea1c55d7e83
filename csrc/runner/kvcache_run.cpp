// kvcache_run: greedy generation from a TorchScript model, in C++ only.
//
//   kvcache_run MODEL.pt PROMPT.pt NEW_TOKENS OUT.pt
//
// MODEL.pt is a scripted kvcache.models.StatefulDecoder (or any module with
// forward(tokens: Tensor[B, S] int64) -> logits Tensor[B, S, V] that keeps
// its own KV cache and advances it). PROMPT.pt holds a (B, S)
// int64 tensor saved with torch.save. OUT.pt receives, readable with
// torch.load, a tuple (tokens (B, NEW_TOKENS) int64, logits (B, NEW_TOKENS, V)
// float32): the greedy tokens and the logits that chose them.
//
// The model calls torch.ops.kvcache.* through the dispatcher only, so this
// program references no kvcache symbol; it is linked with --no-as-needed
// (CMakeLists.txt) so the library still loads and registers the operators.
#include <torch/csrc/jit/serialization/pickle.h>
#include <torch/script.h>

#include <cstdlib>
#include <fstream>
#include <iostream>
#include <iterator>
#include <string>
#include <vector>

namespace {

std::vector<char> read_file(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) throw std::runtime_error("cannot open " + path);
  return {std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>()};
}

void write_file(const std::string& path, const std::vector<char>& bytes) {
  std::ofstream out(path, std::ios::binary);
  out.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
  if (!out) throw std::runtime_error("cannot write " + path);
}

}  // namespace

int main(int argc, char** argv) {
  if (argc != 5) {
    std::cerr << "usage: " << argv[0] << " MODEL.pt PROMPT.pt NEW_TOKENS OUT.pt\n";
    return 2;
  }
  try {
    const std::string model_path = argv[1], prompt_path = argv[2], out_path = argv[4];
    const long new_tokens = std::stol(argv[3]);
    if (new_tokens < 1) throw std::invalid_argument("NEW_TOKENS must be >= 1");

    if (!c10::Dispatcher::singleton().findSchema({"kvcache::append_", ""})) {
      throw std::runtime_error("kvcache operators are not registered (link with --no-as-needed)");
    }
    torch::jit::Module model = torch::jit::load(model_path);
    model.eval();
    const at::Tensor prompt = torch::jit::pickle_load(read_file(prompt_path)).toTensor();
    if (prompt.dim() != 2 || prompt.scalar_type() != at::kLong) {
      throw std::invalid_argument("PROMPT.pt must hold a (batch, seq) int64 tensor");
    }

    torch::InferenceMode guard;
    at::Tensor logits = model.forward({prompt}).toTensor();
    at::Tensor last = logits.select(1, -1);
    std::vector<at::Tensor> tokens, chosen;
    for (long step = 0; step < new_tokens; ++step) {
      at::Tensor token = last.argmax(-1);
      tokens.push_back(token);
      chosen.push_back(last);
      if (step + 1 == new_tokens) break;
      logits = model.forward({token.unsqueeze(1)}).toTensor();
      last = logits.select(1, 0);
    }
    // A plain tuple, so torch.load(weights_only=True) reads it.
    const auto result = c10::ivalue::Tuple::create({at::stack(tokens, 1), at::stack(chosen, 1)});
    write_file(out_path, torch::jit::pickle_save(c10::IValue(result)));
    std::cout << "kvcache_run: " << new_tokens << " tokens x " << prompt.size(0) << " rows -> "
              << out_path << "\n";
  } catch (const std::exception& e) {
    std::cerr << "kvcache_run: " << e.what() << "\n";
    return 1;
  }
  return 0;
}
