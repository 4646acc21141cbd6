#pragma once

// Inputs that LibTorch's own archive reader mishandles, for the targets that read archives
// (fuzz_load, fuzz_compression). The bytes go through torch::serialize::InputArchive::load_from
// before any gwt code runs; two known LibTorch defects turn some crafted archives into a crash or
// an unbounded allocation there, or into a tensor that reaches past its memory. They are not gwt's
// to fix (gwt's load() receives an InputArchive and cannot see the bytes), so the targets discard
// such inputs, as they discard the archives load_from rejects:
//
// - pickle_lengths_out_of_range: the unpickler allocates whatever a length or memo index in the
//   pickle says (BINBYTES8 / BINUNICODE8 of 4 GB, LONG_BINPUT of 2^32 entries) before it reads a
//   byte of it (torch/csrc/jit/serialization/unpickler.cpp; pytorch/pytorch#185443). Screened
//   before load_from.
// - misread: a storage sized by the pickle's numel x itemsize over a zip record that holds fewer
//   bytes (unpickler.cpp, BINPERSID; pytorch/pytorch#109791, open). Checked after load_from.

#include <ATen/ATen.h>
#include <caffe2/serialize/read_adapter_interface.h>
#include <caffe2/serialize/inline_container.h>
#include <sanitizer/allocator_interface.h>
#include <torch/serialize/input-archive.h>

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <string>
#include <unordered_set>
#include <vector>

namespace gwt_fuzz {

/// Whether a pickle stream has a length field that runs past the stream's end, or a memo index
/// larger than the stream could fill. Walks the opcodes LibTorch's unpickler reads; at an opcode
/// it does not know it stops and says no (the unpickler itself rejects what follows).
inline bool pickle_stream_out_of_range(const uint8_t* p, size_t n) {
  size_t i = 0;
  auto le = [&](size_t at, int bytes) {
    uint64_t v = 0;
    for (int b = bytes - 1; b >= 0; --b) v = (v << 8) | p[at + static_cast<size_t>(b)];
    return v;
  };
  // A fixed-size argument of `bytes` bytes.
  auto skip = [&](size_t bytes) {
    if (bytes > n - i) return false;
    i += bytes;
    return true;
  };
  // A length of `bytes` bytes followed by that many bytes; false if it does not fit.
  auto counted = [&](int bytes) {
    if (static_cast<size_t>(bytes) > n - i) return false;
    const uint64_t len = le(i, bytes);
    i += static_cast<size_t>(bytes);
    if (len > n - i) return false;
    i += static_cast<size_t>(len);
    return true;
  };
  auto line = [&]() {
    const void* nl = std::memchr(p + i, '\n', n - i);
    if (nl == nullptr) return false;
    i = static_cast<size_t>(static_cast<const uint8_t*>(nl) - p) + 1;
    return true;
  };
  // A memo index (BINPUT/LONG_BINPUT/BINGET/LONG_BINGET): the unpickler resizes its memo to it.
  auto memo = [&](int bytes) {
    if (static_cast<size_t>(bytes) > n - i) return false;
    const uint64_t index = le(i, bytes);
    i += static_cast<size_t>(bytes);
    return index <= n;
  };
  while (i < n) {
    const uint8_t op = p[i++];
    bool ok = true;
    switch (op) {
      case '.':  // STOP
        return false;
      case '(': case '0': case '1': case '2': case '}': case ']': case ')': case 'a': case 'e':
      case 'b': case 'd': case 'l': case 't': case 0x85: case 0x86: case 0x87: case 0x88:
      case 0x89: case 'N': case 'R': case 's': case 'u': case 0x81: case 'Q': case 0x94:
      case 0x8f: case 0x90: case 0x91: case 0x92: case 0x93: case 'o':
        break;
      case 0x80: ok = skip(1); break;                      // PROTO
      case 0x95: ok = skip(8); break;                      // FRAME
      case 'J': ok = skip(4); break;                       // BININT
      case 'K': ok = skip(1); break;                       // BININT1
      case 'M': ok = skip(2); break;                       // BININT2
      case 'G': ok = skip(8); break;                       // BINFLOAT
      case 0x82: ok = skip(1); break;                      // EXT1
      case 0x83: ok = skip(2); break;                      // EXT2
      case 0x84: ok = skip(4); break;                      // EXT4
      case 0x8a: case 'C': case 0x8c: case 'U': ok = counted(1); break;  // LONG1, short strings
      case 0x8b: case 'X': case 'B': case 'T': ok = counted(4); break;   // LONG4, strings
      case 0x8d: case 0x8e: case 0x96: ok = counted(8); break;           // 8-byte lengths
      case 'q': case 'h': ok = memo(1); break;             // BINPUT, BINGET
      case 'r': case 'j': ok = memo(4); break;             // LONG_BINPUT, LONG_BINGET
      case 'c': case 'i': ok = line() && line(); break;    // GLOBAL, INST
      case 'I': case 'L': case 'S': case 'V': case 'F': case 'p': case 'g': case 'P':
        ok = line();
        break;
      default:
        return false;  // not an opcode the unpickler reads: it throws there
    }
    if (!ok) return true;
  }
  return false;
}

/// LibTorch's caffe2::serialize::MemoryReadAdapter, mended: its read() calls memcpy with a null
/// destination for a zero-length record (UBSan's nonnull-attribute; found by fuzz_load once the
/// reader, an inline header, ran instrumented here). This one copies only what there is.
class BufferReadAdapter final : public caffe2::serialize::ReadAdapterInterface {
 public:
  BufferReadAdapter(const uint8_t* data, size_t size) : data_(data), size_(size) {}
  size_t size() const override { return size_; }
  size_t read(uint64_t pos, void* buf, size_t n, const char* /*what*/) const override {
    if (pos >= size_) return 0;
    n = std::min<size_t>(n, size_ - static_cast<size_t>(pos));
    if (n > 0) std::memcpy(buf, data_ + pos, n);
    return n;
  }

 private:
  const uint8_t* data_;
  size_t size_;
};

/// No gwt archive holds a record near this size. LibTorch allocates what a record declares before
/// it reads a byte: a 6 KB input whose code/*.py entry said 2 GB had it allocate and fill 2 GB for
/// >10 s (fuzz_load's timeout).
constexpr uint64_t k_record_limit = uint64_t{64} << 20;

/// Calls fn(header, after) for every zip central-directory entry in `data`, where `header` is the
/// entry's fixed 46-byte part and `after` the bytes of the input that follow it, until fn returns
/// true (and then returns true). Every "PK\1\2" signature in the input is taken as an entry,
/// wherever it lies: a superset of the entries miniz can find by any end-of-directory record it
/// settles on, so the screens below never depend on how miniz reads a damaged directory.
template <typename Fn>
bool any_central_entry(const uint8_t* data, size_t size, Fn&& fn) {
  constexpr size_t k_header = 46;  // central directory file header, fixed part
  for (size_t i = 0; i + k_header <= size; ++i) {
    if (data[i] != 'P' || data[i + 1] != 'K' || data[i + 2] != 1 || data[i + 3] != 2) continue;
    if (fn(data + i, size - i - k_header)) return true;
  }
  return false;
}

/// Whether any zip central-directory entry in `data` declares an uncompressed size over
/// k_record_limit (or defers it to a zip64 field, 0xFFFFFFFF). Read from the bytes alone, before
/// LibTorch opens anything: its PyTorchStreamReader reads the archive's version record while it is
/// being constructed, at the size the entry declares, so a 4.7 KB input whose `version` declared
/// 512 MiB took 0.6 s per opening under ASan, and load_from itself once ran past the 10 s timeout
/// copying such a record into an error message.
inline bool declares_large_record(const uint8_t* data, size_t size) {
  return any_central_entry(data, size, [](const uint8_t* h, size_t) {
    const uint64_t uncompressed = uint64_t{h[24]} | uint64_t{h[25]} << 8 |
                                  uint64_t{h[26]} << 16 | uint64_t{h[27]} << 24;
    return uncompressed > k_record_limit;  // 0xFFFFFFFF (zip64) included
  });
}

/// The names of the zip central-directory entries in `data` (any_central_entry) whose name ends in
/// "pkl" in any case, without the entry's first directory (the archive's name, which the reader
/// puts in front of every lookup), once per name up to case.
///
/// Any case, because miniz looks names up without regard to case (mz_zip_reader_locate_file with no
/// flags compares through MZ_TOLOWER, ASCII only): load_from's lookup of "data.pkl" reads an entry
/// named "archive/data.pkL". A screen that took only names ending in "pkl" left that record unread:
/// a hand-made input with a LONG_BINPUT of 4e9 there made LibTorch ask for 60 GiB (it is in
/// fuzz/corpus/compression and fuzz/corpus/load). A CI run (fuzz_compression, 2026-12-06) had
/// stopped on such an allocation after a bit flip; its input stayed on that machine.
inline std::vector<std::string> pickle_entry_names(const uint8_t* data, size_t size) {
  constexpr size_t k_header = 46;
  auto lower = [](char c) { return c >= 'A' && c <= 'Z' ? static_cast<char>(c + 32) : c; };
  std::vector<std::string> names;
  std::unordered_set<std::string> seen;  // one lookup per record, however often it is listed
  any_central_entry(data, size, [&](const uint8_t* h, size_t after) {
    const size_t length = size_t{h[28]} | size_t{h[29]} << 8;
    if (length > after) return false;  // runs past the input: miniz rejects it too
    std::string name(reinterpret_cast<const char*>(h + k_header), length);
    const size_t slash = name.find('/');
    if (slash == std::string::npos) return false;  // outside any directory: no lookup reaches it
    name.erase(0, slash + 1);
    std::string key(name.size(), '\0');
    std::transform(name.begin(), name.end(), key.begin(), lower);
    if (key.size() >= 3 && key.compare(key.size() - 3, 3, "pkl") == 0 && seen.insert(key).second)
      names.push_back(std::move(name));
    return false;
  });
  return names;
}

/// Whether any record of the archive in `data` declares more than 64 MiB, or any pickle record
/// fails pickle_stream_out_of_range: every entry pickle_entry_names gives (data.pkl, constants.pkl
/// and the code's *.debug_pkl, whatever their case), looked up through the reader load_from uses.
/// Bytes that are not a zip archive LibTorch opens say no: load_from rejects them itself.
///
/// Record sizes are declares_large_record's: it runs before any reader opens, and every size a
/// reader reports comes from an entry it has read. So only pickle records are looked up here.
///
/// The names come from the bytes, not from the reader's listing: getAllRecords throws on an entry
/// outside the archive's directory (compared with case) while load_from still reads the records it
/// needs, and it cuts names at 512 bytes.
///
/// A record whose lookup throws is looked up once more. The reader keeps miniz's last error, and a
/// call that does not check it can leave it set (getRecordSize of an entry with an unknown
/// compression method returns its size and leaves "unsupported method" behind); the next hasRecord,
/// of any record, throws on it and so clears it. That once hid a LONG_BINPUT of 1.9e9 in data.pkl
/// behind a damaged tensor record listed before it, and LibTorch asked for 31 GB
/// (fuzz_compression, CI, 2026-12-05; the input is in fuzz/corpus/compression).
inline bool pickle_lengths_out_of_range(const uint8_t* data, size_t size) {
  if (declares_large_record(data, size)) return true;
  std::unique_ptr<caffe2::serialize::PyTorchStreamReader> reader;
  try {
    reader = std::make_unique<caffe2::serialize::PyTorchStreamReader>(
        std::make_shared<BufferReadAdapter>(data, size));
  } catch (const std::exception&) {
    return false;
  }
  // 1: out of range; 0: not; -1: the reader threw.
  auto check = [&](const std::string& name) -> int {
    try {
      if (!reader->hasRecord(name)) return 0;
      const auto [ptr, bytes] = reader->getRecord(name);
      return pickle_stream_out_of_range(static_cast<const uint8_t*>(ptr.get()), bytes) ? 1 : 0;
    } catch (const std::exception&) {
      return -1;
    }
  };
  for (const auto& name : pickle_entry_names(data, size)) {
    int verdict = check(name);
    if (verdict < 0) verdict = check(name);  // a stale error, now cleared, or the record's own
    if (verdict > 0) return true;
    // Still -1: a record the reader cannot read; load_from fails on it too (or never reads it).
  }
  return false;
}

/// Whether LibTorch's archive reader handed out a tensor that reaches past its own memory.
///
/// LibTorch's unpickler builds each storage with the byte size the pickle declares (numel x
/// itemsize) on the buffer of the zip record it names, without comparing the two
/// (torch/csrc/jit/serialization/unpickler.cpp, BINPERSID; pytorch/pytorch#109791, open): a
/// crafted archive whose pickle declares more elements than its record holds loads "fine", and the
/// first read of that tensor, by anyone, runs off the end of a heap buffer. No public LibTorch API
/// shows a storage's real allocation, so gwt's load() cannot see it; AddressSanitizer can (these
/// targets always run under it): the size of the live allocation that the storage's data starts.
/// An input for which this returns true is LibTorch's defect, not gwt's, and the targets discard
/// it as they discard archives load_from rejects. Walks every attribute, nested archive, list,
/// dict and tuple of the archive.
inline bool libtorch_misread(const c10::IValue& v, std::unordered_set<const void*>& seen) {
  if (v.isTensor()) {
    const at::Tensor& t = v.toTensor();
    if (!t.defined() || !t.has_storage()) return false;
    const auto& storage = t.storage();
    const void* data = storage.data();
    // The extent the tensor's sizes, strides and offset reach, in bytes.
    int64_t last = t.storage_offset();
    bool empty = false;
    for (int64_t d = 0; d < t.dim(); ++d) {
      if (t.size(d) == 0) empty = true;
      else last += (t.size(d) - 1) * std::abs(t.stride(d));
    }
    const auto need = empty ? 0 : static_cast<size_t>(last + 1) * t.element_size();
    if (need == 0 && storage.nbytes() == 0) return false;
    if (data == nullptr) return true;
    if (!__sanitizer_get_ownership(data)) return false;  // not a heap block (e.g. a constant)
    const size_t allocated = __sanitizer_get_allocated_size(data);
    return storage.nbytes() > allocated || need > allocated;
  }
  if (v.isObject()) {
    const auto obj = v.toObject();
    if (!seen.insert(obj.get()).second) return false;
    for (const auto& slot : obj->slots())
      if (libtorch_misread(slot, seen)) return true;
    return false;
  }
  if (v.isList()) {
    for (const auto& e : v.toListRef())
      if (libtorch_misread(e, seen)) return true;
    return false;
  }
  if (v.isTuple()) {
    for (const auto& e : v.toTupleRef().elements())
      if (libtorch_misread(e, seen)) return true;
    return false;
  }
  if (v.isGenericDict()) {
    for (const auto& e : v.toGenericDict())
      if (libtorch_misread(e.key(), seen) || libtorch_misread(e.value(), seen)) return true;
    return false;
  }
  return false;
}

inline bool libtorch_misread(torch::serialize::InputArchive& archive) {
  std::unordered_set<const void*> seen;
  for (const auto& key : archive.keys()) {
    c10::IValue value;
    if (archive.try_read(key, value) && libtorch_misread(value, seen)) return true;
  }
  return false;
}

/// The archive in `data`, read as the archive targets read their input, or false where the input
/// is to be skipped: bytes whose pickles LibTorch would over-allocate for
/// (pickle_lengths_out_of_range), bytes load_from rejects (not an archive it reads: its own
/// std::exceptions never reach gwt), and archives LibTorch misreads (libtorch_misread).
inline bool read_archive(const uint8_t* data, size_t size,
                         torch::serialize::InputArchive& archive) {
  if (pickle_lengths_out_of_range(data, size)) return false;
  try {
    archive.load_from(reinterpret_cast<const char*>(data), size);
  } catch (const std::exception&) {
    return false;
  }
  return !libtorch_misread(archive);
}

}  // namespace gwt_fuzz
