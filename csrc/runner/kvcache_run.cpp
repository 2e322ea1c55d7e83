// kvcache_run: greedy generation from a TorchScript model or an AOTInductor
// package, in C++ only.
//
//   kvcache_run MODEL.pt PROMPT.pt NEW_TOKENS OUT.pt
//   kvcache_run STEP.pt2 PROMPT.pt NEW_TOKENS OUT.pt
//
// MODEL.pt is a scripted kvcache.models.StatefulDecoder (or any module with
// forward(tokens: Tensor[B, S] int64) -> logits Tensor[B, S, V] that keeps
// its own KV cache and advances it). STEP.pt2 (the name ends in .pt2) is an
// AOTInductor package of such a module's single-token decode step
// (torch.export of forward(tokens[B, 1]), then
// torch._inductor.aoti_compile_and_package): the package keeps the cache
// buffers as its own state, and the prompt is fed to it one token a step;
// its inputs are checked against the shapes and dtypes it was compiled for
// (AOTI_RUNTIME_CHECK_INPUTS), so a prompt of another batch size is refused.
// PROMPT.pt holds a (B, S) int64 tensor saved with torch.save. OUT.pt
// receives, readable with torch.load, a tuple (tokens (B, NEW_TOKENS) int64,
// logits (B, NEW_TOKENS, V) float32): the greedy tokens and the logits that
// chose them.
//
// Both call torch.ops.kvcache.* through the dispatcher only (the package
// through AOTInductor's proxy executor), so this program references no
// kvcache symbol; it is linked with --no-as-needed (CMakeLists.txt) so the
// library still loads and registers the operators.
#include <torch/csrc/inductor/aoti_package/model_package_loader.h>
#include <torch/csrc/jit/serialization/pickle.h>
#include <torch/script.h>

#include <cstdlib>
#include <fstream>
#include <functional>
#include <iostream>
#include <iterator>
#include <memory>
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
    std::cerr << "usage: " << argv[0] << " MODEL.pt|STEP.pt2 PROMPT.pt NEW_TOKENS OUT.pt\n";
    return 2;
  }
  try {
    const std::string model_path = argv[1], prompt_path = argv[2], out_path = argv[4];
    const std::string count = argv[3];
    size_t parsed = 0;
    long new_tokens = 0;
    try {
      new_tokens = std::stol(count, &parsed);
    } catch (const std::exception&) {
      parsed = 0;
    }
    if (parsed == 0 || parsed != count.size() || new_tokens < 1) {
      throw std::invalid_argument("NEW_TOKENS must be an integer >= 1, got '" + count + "'");
    }

    if (!c10::Dispatcher::singleton().findSchema({"kvcache::append_", ""})) {
      throw std::runtime_error("kvcache operators are not registered (link with --no-as-needed)");
    }
    const at::Tensor prompt = torch::jit::pickle_load(read_file(prompt_path)).toTensor();
    if (prompt.dim() != 2 || prompt.scalar_type() != at::kLong || prompt.size(0) < 1 || prompt.size(1) < 1) {
      throw std::invalid_argument("PROMPT.pt must hold a (batch, seq) int64 tensor, batch and seq >= 1");
    }

    // One call of the model: tokens (B, S) -> logits (B, S, V) (step checks them), and how the
    // prompt goes in: whole, or to a package (compiled for one-token steps) a token at a time.
    std::function<at::Tensor(const at::Tensor&)> call, feed;
    auto step = [&call](const at::Tensor& tokens) {
      at::Tensor logits = call(tokens);
      if (logits.dim() != 3 || logits.size(0) != tokens.size(0) || logits.size(1) != tokens.size(1) ||
          logits.size(2) < 1) {
        throw std::runtime_error("the model must return logits (batch=" + std::to_string(tokens.size(0)) +
                                 ", seq=" + std::to_string(tokens.size(1)) + ", vocab), got " +
                                 c10::str(logits.sizes()));
      }
      return logits;
    };
    if (model_path.size() > 4 && model_path.compare(model_path.size() - 4, 4, ".pt2") == 0) {
      // The package checks each input's shape and dtype against what it was compiled for (a
      // batch other than the export's would read past the token buffer): the generated code
      // reads this once, at its first run.
      setenv("AOTI_RUNTIME_CHECK_INPUTS", "1", 0);
      auto package = std::make_shared<torch::inductor::AOTIModelPackageLoader>(model_path);
      call = [package](const at::Tensor& tokens) {
        std::vector<at::Tensor> out = package->run({tokens});
        if (out.size() != 1) throw std::runtime_error("the package must return one tensor (the logits)");
        return out[0];
      };
      // Fresh (B, 1) tensors: contiguous() keeps a (1, 1) slice's strides, which the package
      // refuses.
      feed = [&step](const at::Tensor& prompt) {
        at::Tensor logits;
        for (int64_t i = 0; i < prompt.size(1); ++i) {
          logits = step(prompt.narrow(1, i, 1).clone(at::MemoryFormat::Contiguous));
        }
        return logits;
      };
    } else {
      auto scripted = std::make_shared<torch::jit::Module>(torch::jit::load(model_path));
      scripted->eval();
      call = [scripted](const at::Tensor& tokens) { return scripted->forward({tokens}).toTensor(); };
      feed = step;
    }

    torch::InferenceMode guard;
    at::Tensor logits = feed(prompt);
    at::Tensor last = logits.select(1, -1);
    std::vector<at::Tensor> tokens, chosen;
    for (long i = 0; i < new_tokens; ++i) {
      at::Tensor token = last.argmax(-1);
      tokens.push_back(token);
      chosen.push_back(last);
      if (i + 1 == new_tokens) break;
      logits = step(token.unsqueeze(1));
      last = logits.select(1, 0);
    }
    // A plain tuple, so torch.load(weights_only=True) reads it.
    const auto result = c10::ivalue::Tuple::create({at::stack(tokens, 1), at::stack(chosen, 1)});
    write_file(out_path, torch::jit::pickle_save(c10::IValue(result)));
    std::cout << "kvcache_run: " << new_tokens << " tokens x " << prompt.size(0) << " rows -> "
              << out_path << "\n";
  } catch (const c10::Error& e) {  // the message without the C++ backtrace
    std::cerr << "kvcache_run: " << e.what_without_backtrace() << "\n";
    return 1;
  } catch (const std::exception& e) {
    std::cerr << "kvcache_run: " << e.what() << "\n";
    return 1;
  }
  return 0;
}
