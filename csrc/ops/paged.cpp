#include "paged.h"

#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <string>

#include "../core/checks.h"
#include "../core/overlap.h"
#include "../core/tensor_params.h"

namespace kvcache {
namespace detail {

DeviceStub<PagedWriteFn> paged_write_stub;
DeviceStub<AttendFn> paged_attend_stub;

namespace {

constexpr const char* kPagesDims = "(num_blocks, block_size, num_kv_heads, head_dim)";

// The pages both ops take: dense, 4-D, the same shape, dtype and device.
void check_pages(const at::Tensor& key_pages, const at::Tensor& value_pages) {
  check_dense(key_pages, "key_pages");
  check_dense(value_pages, "value_pages");
  check_rank(key_pages, 4, "key_pages", kPagesDims);
  check_rank(value_pages, 4, "value_pages", kPagesDims);
  TORCH_CHECK_VALUE(same_sizes(value_pages, key_pages),
                    "value_pages must have the same shape as key_pages ",
                    shape_str(key_pages), ", got ", shape_str(value_pages));
  TORCH_CHECK_TYPE(value_pages.scalar_type() == key_pages.scalar_type(),
                   "value_pages must have the dtype of key_pages (",
                   py_dtype(key_pages.scalar_type()), "), got ",
                   py_dtype(value_pages.scalar_type()));
  check_device(value_pages, key_pages.device(), "value_pages", "the device of key_pages");
  TORCH_CHECK_VALUE(holds(key_pages.sym_size(1).sym_gt(0)),
                    "key_pages must have block_size >= 1, got shape ", shape_str(key_pages));
  // Slots are numbered block * block_size + offset in int32 tables and
  // mappings (as vLLM's and transformers' are): the pages hold at most
  // INT32_MAX slots.
  TORCH_CHECK_VALUE(holds((key_pages.sym_size(0) * key_pages.sym_size(1)).sym_le(kMaxLen)),
                    "key_pages holds ", shown(key_pages.sym_size(0)), " x ",
                    shown(key_pages.sym_size(1)),
                    " slots; slot numbers are int32, so pages hold at most ", kMaxLen);
}

// Scales of quantized pages: given exactly when the pages are int8/fp8,
// dense float32 (num_blocks, block_size, num_kv_heads) on their device.
// The mistakes raise what the same mistake raises in the contiguous ops: a
// write (update_) a TypeError for scales with plain pages or none with
// quantized pages (the data's dtype does not fit the write's format) and a
// ValueError for one scale of two; a read (attend) a ValueError.
void check_page_scales(const at::Tensor& key_pages, const std::optional<at::Tensor>& key_scales,
                       const std::optional<at::Tensor>& value_scales, bool written) {
  const KvFormat format = format_of(key_pages.scalar_type());
  const bool both = key_scales.has_value() && value_scales.has_value();
  const bool neither = !key_scales.has_value() && !value_scales.has_value();
  TORCH_CHECK_VALUE(both || neither, key_scales.has_value() ? "key_scales" : "value_scales",
                    " is given without ", key_scales.has_value() ? "value_scales" : "key_scales",
                    ": quantized pages need both, plain pages neither");
  // Scales that do not fit the pages' format: the write's TypeError, the read's ValueError.
  auto refuse = [written](const std::string& msg) {
    if (written) TORCH_CHECK_TYPE(false, msg);
    TORCH_CHECK_VALUE(false, msg);
  };
  if (format == KvFormat::kPlain) {
    if (both) {
      refuse(c10::str("key_scales and value_scales are the scales of quantized pages "
                      "(torch.int8 or torch.float8_e4m3fn), got pages of dtype ",
                      py_dtype(key_pages.scalar_type())));
    }
    return;
  }
  if (neither) {
    refuse(c10::str("key_pages are ", py_dtype(key_pages.scalar_type()),
                    " (quantized): pass both key_scales and value_scales"));
  }
  for (const auto& [t, name] : {std::pair<const at::Tensor&, const char*>{*key_scales, "key_scales"},
                                {*value_scales, "value_scales"}}) {
    if (written) {
      check_writable(t, name);
    } else {
      check_dense(t, name);
    }
    check_rank(t, 3, name, "(num_blocks, block_size, num_kv_heads)");
    TORCH_CHECK_VALUE(holds(t.sym_size(0).sym_eq(key_pages.sym_size(0))) &&
                          holds(t.sym_size(1).sym_eq(key_pages.sym_size(1))) &&
                          holds(t.sym_size(2).sym_eq(key_pages.sym_size(2))),
                      name, " must have shape (num_blocks=", shown(key_pages.sym_size(0)),
                      ", block_size=", shown(key_pages.sym_size(1)),
                      ", num_kv_heads=", shown(key_pages.sym_size(2)),
                      ") to match the pages, got ", shape_str(t));
    check_dtype(t, at::kFloat, name, "the scale dtype");
    check_device(t, key_pages.device(), name, "the device of the pages");
  }
}

// An int32 tensor of `rank` dims on `dev` (the metadata of paged_attend).
void check_meta(const at::Tensor& t, const char* name, int64_t rank, const char* dims,
                const at::Device& dev) {
  check_dense(t, name);
  check_rank(t, rank, name, dims);
  check_dtype(t, at::kInt, name, "dtype");
  check_device(t, dev, name, "the device of q");
}

// The positions a block table of max_blocks pages of block_size slots can
// hold, saturated at INT32_MAX (context_lens are int32, so no length
// exceeds it): max_blocks * block_size of an expand()-ed table with 2^61
// columns would overflow int64.
int64_t table_capacity(int64_t max_blocks, int64_t block_size) {
  constexpr int64_t kMax = std::numeric_limits<int32_t>::max();
  if (block_size <= 0) return 0;
  return max_blocks > kMax / block_size ? kMax : max_blocks * block_size;
}

}  // namespace

void check_paged_write(const at::Tensor& key_pages, const at::Tensor& value_pages,
                       const at::Tensor& key, const at::Tensor& value,
                       const at::Tensor& slot_mapping,
                       const std::optional<at::Tensor>& key_scales,
                       const std::optional<at::Tensor>& value_scales, bool values_known) {
  check_pages(key_pages, value_pages);
  check_writable(key_pages, "key_pages");
  check_writable(value_pages, "value_pages");
  check_dense(key, "key");
  check_dense(value, "value");
  check_rank(key, 3, "key", "(num_tokens, num_kv_heads, head_dim)");
  check_rank(value, 3, "value", "(num_tokens, num_kv_heads, head_dim)");
  const c10::SymInt tokens = key.sym_size(0);
  TORCH_CHECK_VALUE(holds(key.sym_size(1).sym_eq(key_pages.sym_size(2))) &&
                        holds(key.sym_size(2).sym_eq(key_pages.sym_size(3))),
                    "key must have shape (num_tokens, num_kv_heads=", shown(key_pages.sym_size(2)),
                    ", head_dim=", shown(key_pages.sym_size(3)), ") to match the pages, got ",
                    shape_str(key));
  TORCH_CHECK_VALUE(same_sizes(value, key), "value must have the shape of key ",
                    shape_str(key), ", got ", shape_str(value));
  const auto dev = key_pages.device();
  check_device(key, dev, "key", "the device of the pages");
  check_device(value, dev, "value", "the device of the pages");
  const KvFormat format = format_of(key_pages.scalar_type());
  if (format == KvFormat::kPlain) {
    TORCH_CHECK_TYPE(key.scalar_type() == key_pages.scalar_type(), "key is ",
                     py_dtype(key.scalar_type()), " but key_pages are ",
                     py_dtype(key_pages.scalar_type()),
                     ": no implicit casts; pass key.to(", py_dtype(key_pages.scalar_type()), ")");
  } else {
    TORCH_CHECK_TYPE(is_float_dtype(key.scalar_type()),
                     "key must be torch.float32, torch.bfloat16 or torch.float16 "
                     "(quantized into the ", py_dtype(key_pages.scalar_type()),
                     " pages), got ", py_dtype(key.scalar_type()));
  }
  check_dtype(value, key.scalar_type(), "value", "the dtype of key");
  check_page_scales(key_pages, key_scales, value_scales, true);
  check_dense(slot_mapping, "slot_mapping");
  check_int_dtype(slot_mapping, "slot_mapping");
  TORCH_CHECK_VALUE(slot_mapping.dim() == 1 && holds(slot_mapping.sym_size(0).sym_eq(tokens)),
                    "slot_mapping must have shape (num_tokens=", shown(tokens), ",), got ",
                    shape_str(slot_mapping));
  check_device(slot_mapping, dev, "slot_mapping", "the device of the pages");

  // What is written must not share a byte with anything else the call
  // reads or writes.
  TORCH_CHECK_VALUE(!self_overlaps(key_pages) && !self_overlaps(value_pages),
                    "key_pages and value_pages must not have internally overlapping memory "
                    "(for example an expand()ed tensor)");
  std::vector<std::pair<const at::Tensor*, const char*>> written = {
      {&key_pages, "key_pages"}, {&value_pages, "value_pages"}};
  if (key_scales.has_value()) {
    written.push_back({&*key_scales, "key_scales"});
    written.push_back({&*value_scales, "value_scales"});
    TORCH_CHECK_VALUE(!self_overlaps(*key_scales) && !self_overlaps(*value_scales),
                      "key_scales and value_scales must not have internally overlapping memory");
  }
  for (size_t i = 0; i < written.size(); ++i) {
    const Box b = box_of(*written[i].first);
    for (size_t j = i + 1; j < written.size(); ++j) {
      TORCH_CHECK_VALUE(!overlaps(b, box_of(*written[j].first)), written[i].second,
                        " and ", written[j].second, " must not share memory");
    }
    for (const auto& [t, name] : {std::pair<const at::Tensor*, const char*>{&key, "key"},
                                  {&value, "value"},
                                  {&slot_mapping, "slot_mapping"}}) {
      TORCH_CHECK_VALUE(!overlaps(b, box_of(*t)), name, " must not share memory with ",
                        written[i].second);
    }
  }

  if (!values_known || !dev.is_cpu()) return;
  const int64_t n = tokens.expect_int();
  const int64_t slots = key_pages.size(0) * key_pages.size(1);
  // Each slot at most once: two tokens to one slot would leave whichever
  // the kernel wrote last (on CUDA, a race).
  std::vector<int64_t> seen;
  seen.reserve(static_cast<size_t>(n));
  for (int64_t t = 0; t < n; ++t) {
    const int64_t s = row_value(slot_mapping, t);
    TORCH_CHECK_VALUE(s >= -1 && s < slots,
                      "slot_mapping must hold -1 (skip) or a slot in [0, num_blocks * "
                      "block_size = ", slots, "), got ", s, " at index ", t);
    if (s >= 0) seen.push_back(s);
  }
  std::sort(seen.begin(), seen.end());
  const auto dup = std::adjacent_find(seen.begin(), seen.end());
  TORCH_CHECK_VALUE(dup == seen.end(), "slot_mapping gives slot ",
                    dup == seen.end() ? 0 : *dup,
                    " to more than one token; each slot takes at most one");
}

PagedRows check_paged_attend(const at::Tensor& q, const at::Tensor& key_pages,
                             const at::Tensor& value_pages, const at::Tensor& block_table,
                             const at::Tensor& context_lens, const at::Tensor& cu_seqlens_q,
                             std::optional<double> scale, int64_t window, double softcap,
                             const std::optional<at::Tensor>& key_scales,
                             const std::optional<at::Tensor>& value_scales,
                             const std::optional<at::Tensor>& sink_logits, bool values_known) {
  check_dense(q, "q");
  check_rank(q, 3, "q", "(total_q, num_heads, head_dim)");
  check_pages(key_pages, value_pages);
  const c10::SymInt kv_heads = key_pages.sym_size(2);
  const c10::SymInt head_dim = key_pages.sym_size(3);
  const c10::SymInt heads = q.sym_size(1);
  TORCH_CHECK_VALUE(holds(q.sym_size(2).sym_eq(head_dim)),
                    "q must have shape (total_q, num_heads, head_dim=", shown(head_dim),
                    ") to match the pages, got ", shape_str(q));
  TORCH_CHECK_VALUE(holds(kv_heads.sym_gt(0)) ? holds((heads % kv_heads).sym_eq(0))
                                              : holds(heads.sym_eq(0)),
                    "q has num_heads=", shown(heads),
                    ", which must be a multiple of the pages' num_kv_heads=", shown(kv_heads));
  TORCH_CHECK_TYPE(is_float_dtype(q.scalar_type()),
                   "q must be a torch.float32, torch.bfloat16 or torch.float16 tensor, got ",
                   py_dtype(q.scalar_type()));
  const auto dev = q.device();
  if (format_of(key_pages.scalar_type()) == KvFormat::kPlain) {
    // A dtype paged_attend reads at all first: otherwise the cast named
    // below (q.to(the pages' dtype)) would itself be refused.
    TORCH_CHECK_TYPE(is_float_dtype(key_pages.scalar_type()), "key_pages are ",
                     py_dtype(key_pages.scalar_type()),
                     ": paged_attend reads pages of torch.float32, torch.bfloat16 or torch.float16 "
                     "(q's dtype), or torch.int8 / torch.float8_e4m3fn with key_scales and "
                     "value_scales");
    TORCH_CHECK_TYPE(key_pages.scalar_type() == q.scalar_type(), "q is ",
                     py_dtype(q.scalar_type()), " but key_pages are ",
                     py_dtype(key_pages.scalar_type()),
                     ": q and the pages must have one dtype (no implicit casts): pass q.to(",
                     py_dtype(key_pages.scalar_type()), ")");
  }
  check_device(key_pages, dev, "key_pages", "the device of q");
  check_page_scales(key_pages, key_scales, value_scales, false);
  check_meta(block_table, "block_table", 2, "(num_seqs, max_blocks)", dev);
  const c10::SymInt seqs = block_table.sym_size(0);
  check_meta(context_lens, "context_lens", 1, "(num_seqs,)", dev);
  TORCH_CHECK_VALUE(holds(context_lens.sym_size(0).sym_eq(seqs)),
                    "context_lens must have shape (num_seqs=", shown(seqs),
                    ",) as block_table's rows, got ", shape_str(context_lens));
  check_meta(cu_seqlens_q, "cu_seqlens_q", 1, "(num_seqs + 1,)", dev);
  TORCH_CHECK_VALUE(holds(cu_seqlens_q.sym_size(0).sym_eq(seqs + 1)),
                    "cu_seqlens_q must have shape (num_seqs + 1=", shown(seqs) + 1,
                    ",), got ", shape_str(cu_seqlens_q));
  check_attend_options(scale, window, softcap, shown(head_dim));
  if (sink_logits.has_value()) check_sink_logits(*sink_logits, heads, dev);

  PagedRows rows;
  if (!values_known || !dev.is_cpu()) return rows;
  const int64_t n = seqs.expect_int();
  const int64_t total_q = q.size(0);
  const int64_t bs = key_pages.size(1);
  const int64_t blocks = key_pages.size(0);
  const int64_t max_blocks = block_table.size(1);
  TORCH_CHECK_VALUE(row_value(cu_seqlens_q, 0) == 0, "cu_seqlens_q must start at 0, got ",
                    row_value(cu_seqlens_q, 0));
  // q may hold padding after the last sequence's queries (a batch padded to
  // a fixed token count for compiled or CUDA-graph steps): rows
  // [cu_seqlens_q[num_seqs], total_q) are no sequence's and come out 0.
  TORCH_CHECK_VALUE(row_value(cu_seqlens_q, n) <= total_q,
                    "cu_seqlens_q must end at most at total_q=", total_q,
                    " (q's first dim), got ", row_value(cu_seqlens_q, n));
  rows.q_start.resize(static_cast<size_t>(n + 1));
  rows.context_lens.resize(static_cast<size_t>(n));
  rows.q_start[0] = 0;
  for (int64_t s = 0; s < n; ++s) {
    const int64_t a = row_value(cu_seqlens_q, s), e = row_value(cu_seqlens_q, s + 1);
    TORCH_CHECK_VALUE(e >= a, "cu_seqlens_q must not decrease, got ", a, " then ", e,
                      " at index ", s + 1);
    const int64_t len = row_value(context_lens, s);
    TORCH_CHECK_VALUE(len >= e - a, "context_lens must be >= the sequence's queries (",
                      e - a, ": they are its last tokens), got ", len, " at index ", s);
    TORCH_CHECK_VALUE(len <= table_capacity(max_blocks, bs),
                      "context_lens must be <= max_blocks * block_size = ", max_blocks * bs,
                      " (block_table's capacity), got ", len, " at index ", s);
    rows.q_start[s + 1] = e;
    rows.context_lens[s] = len;
    rows.max_q = std::max(rows.max_q, e - a);
    // The pages of the positions the sequence's queries see (none without
    // queries: such a sequence's table is never read, on CPU or CUDA).
    if (len == 0 || e == a) continue;
    const int64_t first = window > 0 ? std::max<int64_t>(0, len - (e - a) - window + 1) : 0;
    const int32_t* table = block_table.const_data_ptr<int32_t>() + s * block_table.stride(0);
    for (int64_t j = first / bs; j <= (len - 1) / bs; ++j) {
      const int64_t page = table[j * block_table.stride(1)];
      TORCH_CHECK_VALUE(page >= 0 && page < blocks, "block_table must hold pages in [0, num_blocks=",
                        blocks, ") for every block a query sees, got ", page, " at [", s, ", ",
                        j, "]");
    }
  }
  return rows;
}

PagedWriteParams paged_write_params(const at::Tensor& key_pages, const at::Tensor& value_pages,
                                    const at::Tensor& key, const at::Tensor& value,
                                    const at::Tensor& slot_mapping,
                                    const std::optional<at::Tensor>& key_scales,
                                    const std::optional<at::Tensor>& value_scales) {
  PagedWriteParams p;
  p.k_src = static_cast<const char*>(key.const_data_ptr());
  p.v_src = static_cast<const char*>(value.const_data_ptr());
  const int64_t src_es = key.element_size();
  const int64_t es = key_pages.element_size();
  for (int k = 0; k < 3; ++k) {
    p.k_src_stride[k] = key.stride(k) * src_es;
    p.v_src_stride[k] = value.stride(k) * src_es;
  }
  p.k_pages = static_cast<char*>(key_pages.mutable_data_ptr());
  p.v_pages = static_cast<char*>(value_pages.mutable_data_ptr());
  for (int k = 0; k < 4; ++k) {
    p.k_page_stride[k] = key_pages.stride(k) * es;
    p.v_page_stride[k] = value_pages.stride(k) * es;
  }
  p.format = format_of(key_pages.scalar_type());
  if (p.format != KvFormat::kPlain) {
    p.k_scale = key_scales->mutable_data_ptr<float>();
    p.v_scale = value_scales->mutable_data_ptr<float>();
    for (int k = 0; k < 3; ++k) {
      p.ks_stride[k] = key_scales->stride(k);
      p.vs_stride[k] = value_scales->stride(k);
    }
  }
  p.src_dtype = float_dtype_of(key.scalar_type());
  p.elem_size = es;
  p.slots = int_rows(slot_mapping);
  p.num_tokens = key.size(0);
  p.num_kv_heads = key_pages.size(2);
  p.head_dim = key_pages.size(3);
  p.block_size = key_pages.size(1);
  p.num_blocks = key_pages.size(0);
  p.device_index = key_pages.device().index();
  return p;
}

AttendParams paged_attend_params(const at::Tensor& q, const at::Tensor& out,
                                 const at::Tensor& key_pages, const at::Tensor& value_pages,
                                 const at::Tensor& block_table, const at::Tensor& context_lens,
                                 const at::Tensor& cu_seqlens_q, std::optional<double> scale,
                                 int64_t window, double softcap,
                                 const std::optional<at::Tensor>& key_scales,
                                 const std::optional<at::Tensor>& value_scales,
                                 const std::optional<at::Tensor>& sink_logits,
                                 const PagedRows& rows) {
  AttendParams p;
  p.dtype = q.scalar_type() == at::kFloat      ? AttnDtype::kFloat32
            : q.scalar_type() == at::kBFloat16 ? AttnDtype::kBFloat16
                                               : AttnDtype::kFloat16;
  // Varlen queries: {row 0, head, token, element} (AttendParams).
  p.q = q.const_data_ptr();
  p.q_stride[0] = 0;
  p.q_stride[1] = q.stride(1);
  p.q_stride[2] = q.stride(0);
  p.q_stride[3] = q.stride(2);
  p.out = out.mutable_data_ptr();
  p.out_stride[0] = 0;
  p.out_stride[1] = out.stride(1);
  p.out_stride[2] = out.stride(0);
  p.out_stride[3] = out.stride(2);
  // Pages: {page, head, slot in page, element}.
  const int64_t perm[4] = {0, 2, 1, 3};
  p.k = key_pages.const_data_ptr();
  p.v = value_pages.const_data_ptr();
  for (int k = 0; k < 4; ++k) {
    p.k_stride[k] = key_pages.stride(perm[k]);
    p.v_stride[k] = value_pages.stride(perm[k]);
  }
  p.block_table = block_table.const_data_ptr<int32_t>();
  p.bt_stride[0] = block_table.stride(0);
  p.bt_stride[1] = block_table.stride(1);
  p.block_size = key_pages.size(1);
  p.num_blocks = key_pages.size(0);
  p.batch = block_table.size(0);
  p.num_kv_heads = key_pages.size(2);
  p.head_dim = key_pages.size(3);
  p.num_heads = q.size(1);
  p.max_len = table_capacity(block_table.size(1), key_pages.size(1));
  p.scale = static_cast<float>(
      scale.value_or(p.head_dim > 0 ? 1.0 / std::sqrt(double(p.head_dim)) : 1.0));
  p.softcap = static_cast<float>(softcap);
  p.window = window;
  if (sink_logits.has_value()) {
    p.sink_logits = sink_logits->const_data_ptr<float>();
    p.sink_stride = sink_logits->stride(0);
  }
  p.lengths = int_rows(context_lens);
  p.cu_seqlens_q = cu_seqlens_q.const_data_ptr<int32_t>();
  p.cu_stride = cu_seqlens_q.stride(0);
  if (!rows.q_start.empty()) {
    p.host_lengths = rows.context_lens.data();
    p.host_q_start = rows.q_start.data();
    p.seq = rows.max_q;
  } else {
    p.seq = q.size(0);  // CUDA: a bound (the device holds the offsets)
  }
  p.device_index = q.device().index();
  p.kv_format = format_of(key_pages.scalar_type());
  if (p.kv_format != KvFormat::kPlain) {
    p.k_scale = key_scales->const_data_ptr<float>();
    p.v_scale = value_scales->const_data_ptr<float>();
    p.ks_stride[0] = key_scales->stride(0);
    p.ks_stride[1] = key_scales->stride(2);
    p.ks_stride[2] = key_scales->stride(1);
    p.vs_stride[0] = value_scales->stride(0);
    p.vs_stride[1] = value_scales->stride(2);
    p.vs_stride[2] = value_scales->stride(1);
  }
  return p;
}

}  // namespace detail

namespace ops {

void paged_write_(const at::Tensor& key_pages, const at::Tensor& value_pages,
                  const at::Tensor& key, const at::Tensor& value, const at::Tensor& slot_mapping,
                  const std::optional<at::Tensor>& key_scales,
                  const std::optional<at::Tensor>& value_scales) {
  detail::check_paged_write(key_pages, value_pages, key, value, slot_mapping, key_scales,
                            value_scales, true);
  const detail::PagedWriteParams p = detail::paged_write_params(
      key_pages, value_pages, key, value, slot_mapping, key_scales, value_scales);
  if (p.num_tokens > 0 && p.num_kv_heads > 0 && p.head_dim > 0) {
    detail::paged_write_stub.get(key_pages.device().type(), "paged_write_")(p);
  }
}

at::Tensor paged_attend(const at::Tensor& q, const at::Tensor& key_pages,
                        const at::Tensor& value_pages, const at::Tensor& block_table,
                        const at::Tensor& context_lens, const at::Tensor& cu_seqlens_q,
                        std::optional<double> scale, int64_t window, double softcap,
                        const std::optional<at::Tensor>& key_scales,
                        const std::optional<at::Tensor>& value_scales,
                        const std::optional<at::Tensor>& sink_logits) {
  const auto rows = detail::check_paged_attend(q, key_pages, value_pages, block_table,
                                               context_lens, cu_seqlens_q, scale, window,
                                               softcap, key_scales, value_scales, sink_logits,
                                               true);
  // On CUDA the end of the queries (cu_seqlens_q[num_seqs]) is not known on
  // the host: padding rows stay as allocated, so allocate zeros there.
  at::Tensor out = q.device().is_cpu() ? at::empty(q.sizes(), q.options())
                                       : at::zeros(q.sizes(), q.options());
  const detail::AttendParams p = detail::paged_attend_params(
      q, out, key_pages, value_pages, block_table, context_lens, cu_seqlens_q, scale, window,
      softcap, key_scales, value_scales, sink_logits, rows);
  if (out.numel() > 0 && p.seq > 0) {
    detail::paged_attend_stub.get(q.device().type(), "paged_attend")(p);
  }
  if (!rows.q_start.empty() && rows.q_start.back() < q.size(0)) {
    out.narrow(0, rows.q_start.back(), q.size(0) - rows.q_start.back()).zero_();
  }
  return out;
}

}  // namespace ops
}  // namespace kvcache
