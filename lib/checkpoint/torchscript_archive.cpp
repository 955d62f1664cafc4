#include "lib/checkpoint/torchscript_archive.hpp"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cctype>
#include <cerrno>
#include <cstring>
#include <map>
#include <memory>
#include <set>
#include <vector>

#include "fullshard/base/error.hpp"

namespace fullshard::checkpoint {

namespace {

// ---- Bytes: a file read with pread, or memory ------------------------------------------------

class Bytes {
 public:
  virtual ~Bytes() = default;
  virtual std::uint64_t size() const = 0;
  /// Reads [offset, offset + n) or throws (callers check the range first).
  virtual void read(std::uint64_t offset, void* out, std::size_t n) const = 0;
};

class FileBytes final : public Bytes {
 public:
  explicit FileBytes(const std::string& path) : path_(path) {
    fd_ = ::open(path.c_str(), O_RDONLY | O_NONBLOCK | O_CLOEXEC);
    if (fd_ < 0) throw IoError("'" + path + "': cannot open it (" + std::strerror(errno) + ")");
    struct stat st {};
    if (::fstat(fd_, &st) != 0 || !S_ISREG(st.st_mode)) {
      ::close(fd_);
      throw IoError("'" + path + "' is not a regular file");
    }
    size_ = std::uint64_t(st.st_size);
  }
  ~FileBytes() override { ::close(fd_); }
  FileBytes(const FileBytes&) = delete;
  FileBytes& operator=(const FileBytes&) = delete;
  std::uint64_t size() const override { return size_; }
  void read(std::uint64_t offset, void* out, std::size_t n) const override {
    auto* p = static_cast<char*>(out);
    while (n > 0) {
      const ssize_t got = ::pread(fd_, p, n, off_t(offset));
      if (got < 0 && errno == EINTR) continue;
      if (got <= 0)
        throw IoError(
            "'" + path_ + "': read failed at byte " + std::to_string(offset) +
            (got < 0 ? " (" + std::string(std::strerror(errno)) + ")" : " (end of file)"));
      p += got;
      offset += std::uint64_t(got);
      n -= std::size_t(got);
    }
  }

 private:
  std::string path_;
  int fd_ = -1;
  std::uint64_t size_ = 0;
};

class MemoryBytes final : public Bytes {
 public:
  MemoryBytes(const void* data, std::size_t size)
      : data_(static_cast<const unsigned char*>(data)), size_(size) {}
  std::uint64_t size() const override { return size_; }
  void read(std::uint64_t offset, void* out, std::size_t n) const override {
    if (n > 0) std::memcpy(out, data_ + offset, n);
  }

 private:
  const unsigned char* data_;
  std::size_t size_;
};

std::uint64_t le(const unsigned char* p, int n) {
  std::uint64_t v = 0;
  for (int i = n - 1; i >= 0; --i)
    v = (v << 8) | p[i];
  return v;
}

// ---- The zip's central directory -------------------------------------------------------------

struct Record {
  std::uint64_t offset = 0, size = 0;  // of the data in the file; its size once inflated
  bool deflated = false;
};

class ZipDirectory {
 public:
  ZipDirectory(const Bytes& bytes, const std::string& name, const TorchScriptLimits& limits)
      : bytes_(bytes), name_(name) {
    const std::uint64_t size = bytes.size();
    if (size < 22) fail("it is not a zip archive (" + std::to_string(size) + " bytes)");
    // The end of central directory record: within the last 64 KiB + 22 bytes (its comment).
    const std::uint64_t tail = std::min<std::uint64_t>(size, 65535 + 22);
    std::vector<unsigned char> t(tail);
    bytes.read(size - tail, t.data(), tail);
    std::int64_t eocd = -1;
    for (std::int64_t i = std::int64_t(tail) - 22; i >= 0 && eocd < 0; --i)
      if (le(&t[std::size_t(i)], 4) == 0x06054b50u) eocd = i;
    if (eocd < 0) fail("it is not a zip archive (no end of central directory)");
    const unsigned char* e = &t[std::size_t(eocd)];
    std::uint64_t count = le(e + 10, 2), cd_size = le(e + 12, 4), cd_offset = le(e + 16, 4);
    if (count == 0xFFFF || cd_size == 0xFFFFFFFFu || cd_offset == 0xFFFFFFFFu) {
      // Zip64: its locator just before the record names the zip64 end of central directory.
      const std::uint64_t at = size - tail + std::uint64_t(eocd);
      if (at < 20) fail("its zip64 locator is missing");
      unsigned char loc[20];
      bytes.read(at - 20, loc, 20);
      if (le(loc, 4) != 0x07064b50u) fail("its zip64 locator is missing");
      const std::uint64_t z = le(loc + 8, 8);
      if (z > size || size - z < 56) fail("its zip64 end of central directory is outside it");
      unsigned char r[56];
      bytes.read(z, r, 56);
      if (le(r, 4) != 0x06064b50u) fail("its zip64 end of central directory is corrupt");
      count = le(r + 32, 8), cd_size = le(r + 40, 8), cd_offset = le(r + 48, 8);
    }
    if (std::int64_t(count) < 0 || std::int64_t(count) > limits.max_records)
      fail("it has " + std::to_string(count) + " records, more than the limit of " +
           std::to_string(limits.max_records));
    if (cd_offset > size || cd_size > size - cd_offset)
      fail("its central directory lies outside the file");
    // At most a full entry (46 bytes and three 64 KiB fields) per record.
    if (cd_size > count * (46 + 3 * 65535) || cd_size > (std::uint64_t{256} << 20))
      fail("its central directory (" + std::to_string(cd_size) + " bytes) is larger than " +
           std::to_string(count) + " records can be");
    std::vector<unsigned char> cd(cd_size);
    bytes.read(cd_offset, cd.data(), cd_size);
    std::size_t p = 0;
    for (std::uint64_t k = 0; k < count; ++k) {
      if (cd.size() - p < 46 || le(&cd[p], 4) != 0x02014b50u)
        fail("its central directory entry " + std::to_string(k) + " is corrupt");
      const unsigned char* c = &cd[p];
      const std::uint64_t flags = le(c + 8, 2), method = le(c + 10, 2);
      std::uint64_t csize = le(c + 20, 4), usize = le(c + 24, 4), local = le(c + 42, 4);
      const std::size_t nlen = le(c + 28, 2), xlen = le(c + 30, 2), mlen = le(c + 32, 2);
      if (cd.size() - p - 46 < nlen + xlen + mlen)
        fail("its central directory entry " + std::to_string(k) + " is corrupt");
      const std::string entry(reinterpret_cast<const char*>(c + 46), nlen);
      // Zip64 sizes and offset, in that order, for those that do not fit in 32 bits.
      for (std::size_t x = 0; x + 4 <= xlen;) {
        const unsigned char* f = c + 46 + nlen + x;
        const std::size_t id = le(f, 2), len = le(f + 2, 2);
        if (x + 4 + len > xlen) break;
        if (id == 1) {
          std::size_t q = 4;
          auto take = [&](std::uint64_t& v) {
            if (v != 0xFFFFFFFFu) return;
            if (q + 8 > len + 4) fail("record '" + entry + "' has a corrupt zip64 field");
            v = le(f + q, 8);
            q += 8;
          };
          take(usize);
          take(csize);
          take(local);
        }
        x += 4 + len;
      }
      if (flags & 1) fail("record '" + entry + "' is encrypted");
      // torch.jit.save stores its records, its code deflated.
      if (method != 0 && method != 8)
        fail("record '" + entry + "' uses compression method " + std::to_string(method) +
             " (a TorchScript archive stores or deflates its records)");
      if (method == 0 && csize != usize)
        fail("record '" + entry + "' is stored with two sizes (" + std::to_string(csize) + " and " +
             std::to_string(usize) + ")");
      if (local > size || size - local < 30) fail("record '" + entry + "' lies outside the file");
      unsigned char h[30];
      bytes.read(local, h, 30);
      if (le(h, 4) != 0x04034b50u) fail("record '" + entry + "' has no local header");
      const std::uint64_t data = local + 30 + le(h + 26, 2) + le(h + 28, 2);
      if (data > size || csize > size - data)
        fail("record '" + entry + "' (" + std::to_string(csize) +
             " bytes) reaches past the end of the file (truncated?)");
      // LibTorch finds records by name without regard to case: two names that differ only in
      // case would let it read one the check did not.
      std::string lower = entry;
      for (char& ch : lower)
        ch = char(std::tolower(static_cast<unsigned char>(ch)));
      if (!records_.emplace(entry, Record{data, usize, method == 8}).second ||
          !lowercase_.insert(lower).second)
        fail("record '" + entry + "' appears twice (names are compared without regard to case)");
      if (k == 0) first_ = entry;
      p += 46 + nlen + xlen + mlen;
    }
  }

  [[noreturn]] void fail(const std::string& what) const {
    throw IoError("TorchScript file '" + name_ + "': " + what);
  }
  const Record* find(const std::string& entry) const {
    const auto it = records_.find(entry);
    return it == records_.end() ? nullptr : &it->second;
  }
  std::vector<unsigned char> read(const std::string& entry, std::int64_t limit) const {
    const Record* r = find(entry);
    if (r == nullptr) fail("record '" + entry + "' is missing");
    if (r->deflated)
      fail("record '" + entry + "' is deflated; torch.jit.save stores its pickles as they are");
    if (limit < 0 || r->size > std::uint64_t(limit))
      fail("record '" + entry + "' has " + std::to_string(r->size) + " bytes, more than the " +
           std::to_string(limit) + " a pickle may have");
    std::vector<unsigned char> out(r->size);
    bytes_.read(r->offset, out.data(), out.size());
    return out;
  }
  const std::map<std::string, Record>& records() const { return records_; }
  /// The central directory's first entry (LibTorch takes the archive's folder from it).
  const std::string& first() const { return first_; }

 private:
  const Bytes& bytes_;
  std::string name_, first_;
  std::map<std::string, Record> records_;
  std::set<std::string> lowercase_;
};

// ---- The pickles: a stack machine for what torch.jit.save writes ------------------------------

struct Value;
using Items = std::shared_ptr<std::vector<Value>>;

struct Value {
  enum class Kind {
    none,
    integer,
    floating,
    text,
    global,
    tuple,
    storage,
    other
  } kind = Kind::none;
  std::int64_t integer = 0;  // integer; storage: its index
  // text; global: "module.name". Shared: a value is copied by DUP and the memo in O(1).
  std::shared_ptr<const std::string> str;
  Items items;    // tuple
  int depth = 0;  // tuple nesting (a deeper one is kept as `other`: freed without recursion)
  const std::string& text() const {
    static const std::string none;
    return str ? *str : none;
  }
};

struct Storage {
  std::string record;
  std::int64_t numel = 0, item = 0;
};

std::int64_t item_size(const std::string& type) {
  static const std::map<std::string, std::int64_t> sizes = {
      {"torch.FloatStorage", 4},          {"torch.DoubleStorage", 8},
      {"torch.HalfStorage", 2},           {"torch.BFloat16Storage", 2},
      {"torch.LongStorage", 8},           {"torch.IntStorage", 4},
      {"torch.ShortStorage", 2},          {"torch.CharStorage", 1},
      {"torch.ByteStorage", 1},           {"torch.BoolStorage", 1},
      {"torch.ComplexHalfStorage", 4},    {"torch.ComplexFloatStorage", 8},
      {"torch.ComplexDoubleStorage", 16}, {"torch.QInt8Storage", 1},
      {"torch.QUInt8Storage", 1},         {"torch.QInt32Storage", 4},
      {"torch.QUInt4x2Storage", 1},       {"torch.QUInt2x4Storage", 1}};
  const auto it = sizes.find(type);
  return it == sizes.end() ? 0 : it->second;
}

class PickleCheck {
 public:
  PickleCheck(const ZipDirectory& zip, std::string pickle, std::string tensor_prefix,
              std::vector<unsigned char> bytes, std::vector<Storage>& storages)
      : zip_(zip),
        pickle_(std::move(pickle)),
        prefix_(std::move(tensor_prefix)),
        b_(std::move(bytes)),
        storages_(storages) {}

  void run() {
    constexpr std::size_t kMaxDepth = 1 << 20;
    while (true) {
      const std::size_t at = pos_;
      const unsigned char op = byte();
      switch (op) {
        case 0x80:
          byte();
          break;  // PROTO
        case 0x95:
          take(8);
          break;  // FRAME
        case '.':
          return;  // STOP
        case '(':
          marks_.push_back(stack_.size());
          break;  // MARK
        case ')':
          push_tuple({});
          break;  // EMPTY_TUPLE
        case 't':
          push_tuple(pop_mark());
          break;  // TUPLE
        case 0x85:
          push_tuple(pop_n(1));
          break;  // TUPLE1
        case 0x86:
          push_tuple(pop_n(2));
          break;  // TUPLE2
        case 0x87:
          push_tuple(pop_n(3));
          break;  // TUPLE3
        case ']':
        case '}':
          push_other();
          break;  // EMPTY_LIST, EMPTY_DICT
        case 'l':
        case 'd':
          pop_mark();
          push_other();
          break;  // LIST, DICT
        case 'a':
          pop();
          top();
          break;  // APPEND
        case 's':
          pop();
          pop();
          top();
          break;  // SETITEM
        case 'e':
        case 'u':
          pop_mark();
          top();
          break;  // APPENDS, SETITEMS
        case 'N':
          push({});
          break;  // NONE
        case 0x88:
        case 0x89:
          push_int(op == 0x88);
          break;  // NEWTRUE, NEWFALSE
        case 'K':
          push_int(std::int64_t(le(take(1), 1)));
          break;  // BININT1
        case 'M':
          push_int(std::int64_t(le(take(2), 2)));
          break;  // BININT2
        case 'J':
          push_int(std::int64_t(std::int32_t(le(take(4), 4))));
          break;      // BININT
        case 0x8a: {  // LONG1
          const std::size_t n = le(take(1), 1);
          const unsigned char* p = take(n);
          if (n > 8) {
            push_other();
            break;
          }
          std::uint64_t v = n ? le(p, int(n)) : 0;
          if (n > 0 && n < 8 && (p[n - 1] & 0x80)) v |= ~std::uint64_t(0) << (8 * n);
          push_int(std::int64_t(v));
          break;
        }
        case 'G':
          take(8);
          push_kind(Value::Kind::floating);
          break;  // BINFLOAT
        case 'X':
        case 'T':
        case 'B':
          push_text(le(take(4), 4));
          break;  // BINUNICODE ...
        case 0x8c:
        case 'U':
        case 'C':
          push_text(le(take(1), 1));
          break;  // SHORT_*
        case 0x8d:
        case 0x8e:
          push_text(le(take(8), 8));
          break;     // BINUNICODE8, BINBYTES8
        case 'c': {  // GLOBAL: module\nname\n
          const std::string module = line(), name = line();
          push_global(module + "." + name);
          break;
        }
        case 0x93: {  // STACK_GLOBAL
          const Value name = pop(), module = pop();
          if (name.kind != Value::Kind::text || module.kind != Value::Kind::text)
            fail(at, "STACK_GLOBAL of a non-string");
          push_global(module.text() + "." + name.text());
          break;
        }
        case 'R':
          reduce(at);
          break;  // REDUCE
        case 0x81:
          pop();
          pop();
          push_other();
          break;  // NEWOBJ
        case 'b':
          pop();
          top();
          break;  // BUILD
        case 'Q':
          persistent(at);
          break;  // BINPERSID
        case 'q':
          memo_put(le(take(1), 1));
          break;  // BINPUT
        case 'r':
          memo_put(le(take(4), 4));
          break;  // LONG_BINPUT
        case 0x94:
          memo_put(memo_.size());
          break;  // MEMOIZE
        case 'h':
          memo_get(at, le(take(1), 1));
          break;  // BINGET
        case 'j':
          memo_get(at, le(take(4), 4));
          break;  // LONG_BINGET
        case '0':
          pop();
          break;  // POP
        case '1':
          pop_mark();
          break;  // POP_MARK
        case '2':
          push(top());
          break;  // DUP
        default:
          fail(at, "opcode 0x" + hex(op) + " is not one torch.jit.save writes");
      }
      if (stack_.size() > kMaxDepth || marks_.size() > kMaxDepth || memo_.size() > kMaxDepth)
        fail(at, "more than 2^20 values on its stack or in its memo");
    }
  }

 private:
  static std::string hex(unsigned v) {
    const char* d = "0123456789abcdef";
    return std::string{d[(v >> 4) & 15], d[v & 15]};
  }
  [[noreturn]] void fail(std::size_t at, const std::string& what) const {
    zip_.fail("record '" + pickle_ + "' (a pickle), byte " + std::to_string(at) + ": " + what);
  }
  unsigned char byte() { return *take(1); }
  const unsigned char* take(std::size_t n) {
    if (n > b_.size() - pos_) fail(pos_, "it ends inside an opcode's operand (truncated?)");
    const unsigned char* p = b_.data() + pos_;
    pos_ += n;
    return p;
  }
  std::string line() {
    const std::size_t start = pos_;
    while (pos_ < b_.size() && b_[pos_] != '\n')
      ++pos_;
    if (pos_ == b_.size()) fail(start, "GLOBAL without its end of line");
    return std::string(reinterpret_cast<const char*>(b_.data() + start), pos_++ - start);
  }
  void push(Value v) { stack_.push_back(std::move(v)); }
  void push_kind(Value::Kind k) {
    Value v;
    v.kind = k;
    push(std::move(v));
  }
  void push_other() { push_kind(Value::Kind::other); }
  void push_int(std::int64_t i) {
    Value v;
    v.kind = Value::Kind::integer;
    v.integer = i;
    push(std::move(v));
  }
  void push_text(std::uint64_t n) {
    if (n > b_.size() - pos_)
      fail(pos_, "a string of " + std::to_string(n) + " bytes runs past the end");
    Value v;
    v.kind = Value::Kind::text;
    v.str = std::make_shared<const std::string>(reinterpret_cast<const char*>(take(std::size_t(n))),
                                                std::size_t(n));
    push(std::move(v));
  }
  void push_global(std::string name) {
    Value v;
    v.kind = Value::Kind::global;
    v.str = std::make_shared<const std::string>(std::move(name));
    push(std::move(v));
  }
  void push_tuple(std::vector<Value> items) {
    Value v;
    v.kind = Value::Kind::tuple;
    for (const Value& i : items)
      v.depth = std::max(v.depth, i.depth + 1);
    v.depth = std::max(v.depth, 1);
    // The checks read tuples two deep (a rebuild's sizes in its arguments); deeper ones are
    // kept as opaque values, so that freeing them never recurses deeply.
    if (v.depth > 3) {
      push_other();
      return;
    }
    v.items = std::make_shared<std::vector<Value>>(std::move(items));
    push(std::move(v));
  }
  Value pop() {
    if (stack_.empty() || (!marks_.empty() && stack_.size() <= marks_.back()))
      fail(pos_ - 1, "it pops an empty stack");
    Value v = std::move(stack_.back());
    stack_.pop_back();
    return v;
  }
  const Value& top() {
    if (stack_.empty()) fail(pos_ - 1, "it reads an empty stack");
    return stack_.back();
  }
  std::vector<Value> pop_n(std::size_t n) {
    std::vector<Value> out(n);
    for (std::size_t i = n; i-- > 0;)
      out[i] = pop();
    return out;
  }
  std::vector<Value> pop_mark() {
    if (marks_.empty()) fail(pos_ - 1, "it closes a MARK it never opened");
    const std::size_t m = marks_.back();
    marks_.pop_back();
    std::vector<Value> out(std::make_move_iterator(stack_.begin() + std::ptrdiff_t(m)),
                           std::make_move_iterator(stack_.end()));
    stack_.resize(m);
    return out;
  }
  void memo_put(std::uint64_t key) { memo_[key] = top(); }
  void memo_get(std::size_t at, std::uint64_t key) {
    const auto it = memo_.find(key);
    if (it == memo_.end())
      fail(at, "it reads memo entry " + std::to_string(key) + ", never stored");
    push(it->second);
  }

  // ('storage', torch.<Type>Storage, key, location, numel): the storage of record
  // <prefix><key>, which must hold numel elements.
  void persistent(std::size_t at) {
    const Value pid = pop();
    const std::vector<Value>* t = pid.kind == Value::Kind::tuple ? pid.items.get() : nullptr;
    if (t == nullptr || t->size() != 5 || (*t)[0].kind != Value::Kind::text ||
        (*t)[0].text() != "storage" || (*t)[1].kind != Value::Kind::global ||
        (*t)[2].kind != Value::Kind::text || (*t)[4].kind != Value::Kind::integer)
      fail(at, "a persistent id that is not ('storage', type, key, location, numel)");
    const std::string& type = (*t)[1].text();
    const std::int64_t item = item_size(type), numel = (*t)[4].integer;
    const std::string record = prefix_ + (*t)[2].text();
    if (item == 0) fail(at, "storage '" + record + "' has an unknown type " + type);
    if (numel < 0 || numel > (std::int64_t{1} << 60) / item)
      fail(at, "storage '" + record + "' declares " + std::to_string(numel) + " elements");
    const std::int64_t bytes = numel * item;
    if (numel > 0) {  // LibTorch reads no record for an empty storage
      const Record* r = zip_.find(record);
      if (r == nullptr)
        zip_.fail("record '" + record + "' is missing (its storage, " + type + " x " +
                  std::to_string(numel) + ", is declared in '" + pickle_ + "')");
      if (r->size < std::uint64_t(bytes))
        zip_.fail("record '" + record + "' holds " + std::to_string(r->size) +
                  " bytes, but its storage declares " + std::to_string(bytes) + " (" + type +
                  " x " + std::to_string(numel) + "): a truncated or corrupt file");
    }
    Value v;
    v.kind = Value::Kind::storage;
    v.integer = std::int64_t(storages_.size());
    storages_.push_back(Storage{record, numel, item});
    push(std::move(v));
  }

  // torch._utils._rebuild_tensor_v2(storage, offset, sizes, strides, ...): the view must lie
  // inside its storage (LibTorch sets it without looking).
  void reduce(std::size_t at) {
    const Value args = pop(), callable = pop();
    if (callable.kind == Value::Kind::global &&
        (callable.text() == "torch._utils._rebuild_tensor_v2" ||
         callable.text() == "torch._utils._rebuild_tensor")) {
      const std::vector<Value>* a = args.kind == Value::Kind::tuple ? args.items.get() : nullptr;
      if (a == nullptr || a->size() < 4 || (*a)[0].kind != Value::Kind::storage ||
          (*a)[1].kind != Value::Kind::integer || (*a)[2].kind != Value::Kind::tuple ||
          (*a)[3].kind != Value::Kind::tuple || (*a)[2].items->size() != (*a)[3].items->size())
        fail(at,
             callable.text() + " with arguments that are not (storage, offset, sizes, strides)");
      const Storage& s = storages_[std::size_t((*a)[0].integer)];
      const std::int64_t offset = (*a)[1].integer;
      constexpr std::int64_t kMax = std::int64_t{1} << 60;
      if (offset < 0 || offset > kMax)
        fail(at, "a tensor of storage '" + s.record + "' has offset " + std::to_string(offset));
      std::int64_t last = offset;  // the last element the view reaches
      bool empty = false;
      for (std::size_t d = 0; d < (*a)[2].items->size(); ++d) {
        const Value& size = (*(*a)[2].items)[d];
        const Value& stride = (*(*a)[3].items)[d];
        if (size.kind != Value::Kind::integer || stride.kind != Value::Kind::integer ||
            size.integer < 0 || stride.integer < 0 || size.integer > kMax || stride.integer > kMax)
          fail(at, "a tensor of storage '" + s.record + "' has a bad size or stride");
        if (size.integer == 0) empty = true;
        if (size.integer > 0 && stride.integer > 0 &&
            (size.integer - 1) > (kMax - last) / stride.integer)
          fail(at, "a tensor of storage '" + s.record + "' has sizes too large");
        if (size.integer > 0) last += (size.integer - 1) * stride.integer;
      }
      if (!empty && last >= s.numel)
        fail(at, "a tensor of storage '" + s.record + "' reaches element " + std::to_string(last) +
                     " of its " + std::to_string(s.numel) + " (offset " + std::to_string(offset) +
                     ")");
    }
    push_other();
  }

  const ZipDirectory& zip_;
  std::string pickle_, prefix_;
  std::vector<unsigned char> b_;
  std::vector<Storage>& storages_;
  std::size_t pos_ = 0;
  std::vector<Value> stack_;
  std::vector<std::size_t> marks_;
  std::map<std::uint64_t, Value> memo_;
};

TorchScriptArchive check(const Bytes& bytes, const std::string& name,
                         const TorchScriptLimits& limits) {
  const ZipDirectory zip(bytes, name, limits);
  TorchScriptArchive out;
  out.records = std::int64_t(zip.records().size());
  // The archive's folder: the one holding data.pkl (torch.jit.save names it after the file).
  for (const auto& [entry, r] : zip.records()) {
    const std::size_t slash = entry.find('/');
    if (slash != std::string::npos && entry.compare(slash, std::string::npos, "/data.pkl") == 0) {
      if (!out.prefix.empty())
        zip.fail("it holds two archives ('" + out.prefix + "' and '" + entry.substr(0, slash) +
                 "')");
      out.prefix = entry.substr(0, slash);
    }
  }
  if (out.prefix.empty()) zip.fail("it has no data.pkl: not a TorchScript file");
  if (zip.first().compare(0, out.prefix.size() + 1, out.prefix + "/") != 0)
    zip.fail("its first record '" + zip.first() + "' is not in the folder of its data.pkl ('" +
             out.prefix + "')");
  std::vector<Storage> storages;
  for (const char* archive : {"data", "constants"}) {
    const std::string pickle = out.prefix + "/" + archive + ".pkl";
    if (zip.find(pickle) == nullptr) continue;
    PickleCheck(zip, pickle, out.prefix + "/" + archive + "/",
                zip.read(pickle, limits.max_pickle_bytes), storages)
        .run();
  }
  out.storages = std::int64_t(storages.size());
  for (const Storage& s : storages) {
    if (s.numel * s.item > (std::int64_t{1} << 62) - out.storage_bytes)
      zip.fail("its storages declare more than 2^62 bytes together");
    out.storage_bytes += s.numel * s.item;
  }
  return out;
}

}  // namespace

TorchScriptArchive check_torchscript_archive(const std::string& path,
                                             const TorchScriptLimits& limits) {
  const FileBytes bytes(path);
  return check(bytes, path, limits);
}

TorchScriptArchive check_torchscript_archive(const void* data, std::size_t size,
                                             const std::string& name,
                                             const TorchScriptLimits& limits) {
  const MemoryBytes bytes(data, size);
  return check(bytes, name, limits);
}

}  // namespace fullshard::checkpoint
