#include "lib/base/json_reader.hpp"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <fstream>
#include <memory>
#include <sstream>
#include <unordered_set>

#include "fullshard/base/error.hpp"

namespace fullshard::detail {

namespace {

using ojson = nlohmann::ordered_json;
using ObjectVector = ojson::object_t::Container;

bool plain_key(const std::string& key) {
  if (key.empty()) return false;
  for (char ch : key)
    if (ch <= 0x20 || ch >= 0x7F || ch == '.' || ch == '[' || ch == ']' || ch == '"') return false;
  return true;
}

/// `s` as a JSON string literal, ASCII only (controls and non-ASCII escaped), cut to ~80 bytes.
std::string json_string_literal(const std::string& s) {
  std::string out = ojson(s.size() > 80 ? s.substr(0, 80) : s)
                        .dump(-1, ' ', true, ojson::error_handler_t::replace);
  if (s.size() > 80) out.insert(out.size() - 1, "...");
  return out;
}

/// Keys of an object under construction; a hash set once the object is past a few keys (a
/// linear scan is faster for the usual small objects).
class KeySet {
 public:
  /// False when `key` was there already.
  bool insert(const ObjectVector& keys, const std::string& key) {
    if (!set_) {
      for (const auto& kv : keys)
        if (kv.first == key) return false;
      if (keys.size() < kLinear) return true;
      set_ = std::make_unique<std::unordered_set<std::string>>();
      for (const auto& kv : keys)
        set_->insert(kv.first);
    }
    return set_->insert(key).second;
  }

 private:
  static constexpr std::size_t kLinear = 16;
  std::unique_ptr<std::unordered_set<std::string>> set_;
};

struct Frame {
  ojson* value;           // the container being filled
  bool object;            // else an array
  std::size_t key_depth;  // containers under limits.nested_key on the path, this one included
  std::string pending;    // object: the key read whose value is not placed yet
  bool has_pending = false;
  KeySet keys;
};

class Builder {
 public:
  Builder(const std::string& source, const JsonLimits& limits) : source_(source), limits_(limits) {}

  ojson take() { return std::move(root_); }

  // nlohmann::json_sax<ordered_json> interface (duck-typed: sax_parse takes any such class).
  bool null() { return scalar(ojson(nullptr)); }
  bool boolean(bool v) { return scalar(ojson(v)); }
  bool number_integer(ojson::number_integer_t v) { return scalar(ojson(v)); }
  bool number_unsigned(ojson::number_unsigned_t v) { return scalar(ojson(v)); }
  bool number_float(ojson::number_float_t v, const std::string& /*text*/) {
    return scalar(ojson(v));
  }
  bool string(ojson::string_t& v) { return scalar(ojson(std::move(v))); }
  bool binary(ojson::binary_t& v) { return scalar(ojson(std::move(v))); }

  bool start_object(std::size_t /*elements*/) { return open(ojson::object(), true); }
  bool start_array(std::size_t /*elements*/) { return open(ojson::array(), false); }
  bool end_object() { return close(); }
  bool end_array() { return close(); }

  bool key(ojson::string_t& k) {
    Frame& f = stack_.back();
    const auto& keys = static_cast<const ObjectVector&>(f.value->get_ref<ojson::object_t&>());
    if (!f.keys.insert(keys, k)) {
      std::string word = "key";
      if (stack_.size() >= 2) {
        const Frame& parent = stack_[stack_.size() - 2];
        if (parent.object) {
          const auto& pkeys =
              static_cast<const ObjectVector&>(parent.value->get_ref<ojson::object_t&>());
          for (const auto& [first, second] : limits_.duplicate_words)
            if (pkeys.back().first == first) word = second;
        }
      }
      fail(path(false), "duplicate " + word + " " + json_key_shown(k));
    }
    f.pending = std::move(k);
    f.has_pending = true;
    return true;
  }

  bool parse_error(std::size_t position, const std::string& /*last_token*/,
                   const nlohmann::detail::exception& ex) {
    const std::string where = path(true);
    if (ex.id == 406)  // out_of_range: number overflow parsing '1e999'
      fail(where, "number out of range at byte " + std::to_string(position) + ": " + ex.what());
    throw ConfigError(source_ + ": invalid JSON at byte " + std::to_string(position) + ": " +
                      ex.what() + (where.empty() ? std::string() : " (in " + where + ")"));
  }

 private:
  [[noreturn]] void fail(const std::string& path, const std::string& problem) const {
    throw ConfigError(source_ + ": " + (path.empty() ? std::string() : path + ": ") + problem);
  }

  /// Places `v` where the parser is (top level, after a key, or next in an array); returns it.
  ojson* place(ojson&& v) {
    if (stack_.empty()) {
      root_ = std::move(v);
      return &root_;
    }
    Frame& f = stack_.back();
    if (f.object) {
      auto& keys = static_cast<ObjectVector&>(f.value->get_ref<ojson::object_t&>());
      keys.emplace_back(std::move(f.pending), std::move(v));  // unique: checked in key()
      f.pending.clear();
      f.has_pending = false;
      return &keys.back().second;
    }
    auto& items = f.value->get_ref<ojson::array_t&>();
    items.push_back(std::move(v));
    return &items.back();
  }

  bool scalar(ojson&& v) {
    place(std::move(v));
    return true;
  }

  bool open(ojson&& v, bool object) {
    std::size_t key_depth = stack_.empty() ? 0 : stack_.back().key_depth;
    if (!limits_.nested_key.empty() && !stack_.empty() && stack_.back().object &&
        stack_.back().pending == limits_.nested_key)
      ++key_depth;
    if (stack_.size() + 1 > limits_.max_depth)
      fail(path(true), "objects and arrays nest more than " + std::to_string(limits_.max_depth) +
                           " levels deep (the limit)");
    if (!limits_.nested_key.empty() && key_depth > limits_.max_nested_key)
      fail(path(true), limits_.nested_key_problem);
    ojson* slot = place(std::move(v));
    stack_.push_back(Frame{slot, object, key_depth, std::string(), false, KeySet()});
    return true;
  }

  bool close() {
    stack_.pop_back();
    return true;
  }

  /// The JSON path of the container at the top (or, with `pending`, of the value being parsed
  /// in it). Built only for errors; long paths keep their first and last levels.
  std::string path(bool pending) const {
    std::vector<std::string> parts;  // ".key" or "[i]"
    const auto add_key = [&parts](const std::string& k) {
      parts.push_back(json_member("x", k).substr(1));  // ".key" or ".\"k\""
    };
    for (std::size_t i = 0; i + 1 < stack_.size(); ++i) {  // where frame i + 1 lives in frame i
      const Frame& f = stack_[i];
      if (f.object)
        add_key(static_cast<const ObjectVector&>(f.value->get_ref<const ojson::object_t&>())
                    .back()
                    .first);
      else
        parts.push_back("[" + std::to_string(f.value->size() - 1) + "]");
    }
    if (pending && !stack_.empty()) {
      const Frame& f = stack_.back();
      if (f.object && f.has_pending)
        add_key(f.pending);
      else if (!f.object)
        parts.push_back("[" + std::to_string(f.value->size()) + "]");
    }
    constexpr std::size_t kKeep = 8;
    std::string out;
    if (parts.size() <= 3 * kKeep) {
      for (const auto& p : parts)
        out += p;
    } else {
      std::size_t tail = parts.size() - kKeep;
      if (parts[tail][0] == '[') --tail;  // resume at a key: "...(N more levels).modules[0]"
      for (std::size_t i = 0; i < kKeep; ++i)
        out += parts[i];
      out += ".(" + std::to_string(tail - kKeep) + " more levels)";
      for (std::size_t i = tail; i < parts.size(); ++i)
        out += parts[i];
    }
    return !out.empty() && out[0] == '.' ? out.substr(1) : out;
  }

  const std::string& source_;
  const JsonLimits& limits_;
  std::vector<Frame> stack_;
  ojson root_;
};

}  // namespace

std::string json_member(const std::string& path, const std::string& key) {
  const std::string k = plain_key(key) ? key : json_string_literal(key);
  return path.empty() ? k : path + "." + k;
}

std::string json_element(const std::string& path, std::size_t i) {
  return path + "[" + std::to_string(i) + "]";
}

std::string json_key_shown(const std::string& key) {
  for (char ch : key)
    if (ch < 0x20 || ch >= 0x7F || ch == '\'') return json_string_literal(key);
  return key.size() > 80 ? json_string_literal(key) : "'" + key + "'";
}

nlohmann::ordered_json parse_json_strict(const std::string& text, const std::string& source,
                                         const JsonLimits& limits) {
  Builder b(source, limits);
  ojson::sax_parse(text, &b, nlohmann::json::input_format_t::json, true);
  return b.take();
}

}  // namespace fullshard::detail

namespace fullshard {

std::string read_text_file(const std::string& path, const std::string& what,
                           std::uint64_t max_bytes) {
  auto refused = [&](const std::string& why) {
    return ConfigError(path + ": cannot read the " + what + " (" + why + ")");
  };
  // O_NONBLOCK: opening a FIFO must not wait for a writer; the type is checked on the open file.
  const int fd = ::open(path.c_str(), O_RDONLY | O_NONBLOCK | O_CLOEXEC);
  if (fd < 0) throw refused(std::string("cannot open it: ") + std::strerror(errno));
  struct Closer {
    int fd;
    ~Closer() { ::close(fd); }
  } closer{fd};
  struct stat st {};
  if (::fstat(fd, &st) != 0) throw refused(std::string("cannot stat it: ") + std::strerror(errno));
  if (!S_ISREG(st.st_mode))
    throw refused(std::string("it is not a regular file but ") +
                  (S_ISFIFO(st.st_mode)                         ? "a FIFO"
                   : S_ISDIR(st.st_mode)                        ? "a directory"
                   : S_ISCHR(st.st_mode) || S_ISBLK(st.st_mode) ? "a device"
                   : S_ISSOCK(st.st_mode)                       ? "a socket"
                                                                : "not a file"));
  if (std::uint64_t(st.st_size) > max_bytes)
    throw refused(std::to_string(st.st_size) + " bytes, more than the " +
                  std::to_string(max_bytes) + " a " + what + " may have");
  std::string text(std::size_t(st.st_size), '\0');
  std::size_t got = 0;
  while (got < text.size()) {
    const ssize_t n = ::read(fd, text.data() + got, text.size() - got);
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) throw refused(std::string("read failed: ") + std::strerror(errno));
    if (n == 0) break;  // shrank while read
    got += std::size_t(n);
  }
  text.resize(got);
  return text;
}

}  // namespace fullshard
