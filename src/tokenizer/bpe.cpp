#include "tokenizer/bpe.h"

#include <array>
#include <queue>

namespace fp8rl::bpe {
namespace {

void append_utf8(std::string& out, uint32_t cp) {
  if (cp < 0x80) {
    out += char(cp);
  } else if (cp < 0x800) {
    out += char(0xC0 | (cp >> 6));
    out += char(0x80 | (cp & 0x3F));
  } else {
    out += char(0xE0 | (cp >> 12));
    out += char(0x80 | ((cp >> 6) & 0x3F));
    out += char(0x80 | (cp & 0x3F));
  }
}

struct ByteTable {
  std::array<std::string, 256> to_char;
  std::array<int16_t, 512> to_byte;  // every code point of the table is < 512
  ByteTable() {
    to_byte.fill(-1);
    uint32_t next = 256;
    for (int b = 0; b < 256; ++b) {
      const bool printable = (b >= 33 && b <= 126) || (b >= 161 && b <= 172) || (b >= 174);
      const uint32_t cp = printable ? uint32_t(b) : next++;
      append_utf8(to_char[b], cp);
      to_byte[cp] = int16_t(b);
    }
  }
};

const ByteTable& table() {
  static const ByteTable t;
  return t;
}

}  // namespace

const std::string& byte_to_char(uint8_t byte) { return table().to_char[byte]; }

int char_to_byte(uint32_t cp) { return cp < 512 ? table().to_byte[cp] : -1; }

std::string bytes_to_byte_level(std::string_view bytes) {
  std::string out;
  out.reserve(bytes.size() * 2);
  for (unsigned char c : bytes) out += table().to_char[c];
  return out;
}

void MergeTable::reserve(size_t n) {
  size_t cap = 16;
  while (cap < n * 2) cap <<= 1;
  slots_.assign(cap, Entry{});
  mask_ = cap - 1;
  count_ = 0;
}

bool MergeTable::insert(int32_t left, int32_t right, int32_t rank, int32_t merged) {
  if ((count_ + 1) * 2 > slots_.size()) {  // grow: keep load factor <= 0.5
    std::vector<Entry> old = std::move(slots_);
    reserve(count_ + 1 > 8 ? (count_ + 1) * 2 : 16);
    for (const Entry& e : old)
      if (e.key != kEmpty) insert(int32_t(e.key >> 32), int32_t(e.key & 0xffffffffu), e.rank, e.merged);
  }
  const uint64_t key = make_key(left, right);
  size_t i = hash(key) & mask_;
  while (slots_[i].key != kEmpty) {
    if (slots_[i].key == key) return false;
    i = (i + 1) & mask_;
  }
  slots_[i] = Entry{key, rank, merged};
  ++count_;
  return true;
}

namespace {

void merge_word_scan(std::vector<int32_t>& ids, const MergeTable& merges) {
  while (ids.size() > 1) {
    int32_t best_rank = INT32_MAX, best_merged = 0;
    size_t best_pos = 0;
    for (size_t i = 0; i + 1 < ids.size(); ++i) {
      const MergeTable::Entry* e = merges.find(ids[i], ids[i + 1]);
      if (e && e->rank < best_rank) {
        best_rank = e->rank;
        best_merged = e->merged;
        best_pos = i;
      }
    }
    if (best_rank == INT32_MAX) return;
    ids[best_pos] = best_merged;
    ids.erase(ids.begin() + long(best_pos) + 1);
  }
}

void merge_word_heap(std::vector<int32_t>& ids, const MergeTable& merges) {
  const int n = int(ids.size());
  std::vector<int> prev(n), next(n);
  for (int i = 0; i < n; ++i) {
    prev[i] = i - 1;
    next[i] = i + 1 < n ? i + 1 : -1;
  }
  struct Cand {
    int32_t rank;
    int pos;
    int32_t left, right;
    bool operator>(const Cand& o) const { return rank != o.rank ? rank > o.rank : pos > o.pos; }
  };
  std::priority_queue<Cand, std::vector<Cand>, std::greater<Cand>> heap;
  auto push = [&](int pos) {
    if (pos < 0 || next[pos] < 0) return;
    const MergeTable::Entry* e = merges.find(ids[pos], ids[next[pos]]);
    if (e) heap.push(Cand{e->rank, pos, ids[pos], ids[next[pos]]});
  };
  for (int i = 0; i + 1 < n; ++i) push(i);
  std::vector<char> alive(n, 1);
  while (!heap.empty()) {
    const Cand c = heap.top();
    heap.pop();
    const int r = next[c.pos];
    // Stale entry: a neighbour was merged away or changed since this was pushed.
    if (!alive[c.pos] || r < 0 || ids[c.pos] != c.left || ids[r] != c.right) continue;
    ids[c.pos] = merges.find(c.left, c.right)->merged;
    alive[r] = 0;
    next[c.pos] = next[r];
    if (next[r] >= 0) prev[next[r]] = c.pos;
    push(prev[c.pos]);
    push(c.pos);
  }
  size_t w = 0;
  for (int i = 0; i < n; ++i)
    if (alive[i]) ids[w++] = ids[i];
  ids.resize(w);
}

}  // namespace

void merge_word(std::vector<int32_t>& ids, const MergeTable& merges, size_t heap_threshold) {
  if (ids.size() > heap_threshold)
    merge_word_heap(ids, merges);
  else
    merge_word_scan(ids, merges);
}

}  // namespace fp8rl::bpe
