// Stream-K's partition of the own FP8 GEMM's work (src/backend/cuda/stream_k.h), checked on the
// host: what the kernel's CTAs walk and where they leave their partial tiles.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <set>
#include <vector>

#include "backend/cuda/stream_k.h"

namespace fp8rl {
namespace {

namespace sk = cuda::stream_k;

struct Case {
  int64_t tiles;
  int kblocks, ctas;
};

// The decode products of the 1.7B model on 132 SMs (128 x 128 tiles of M = 256 rows), ranges
// within one tile, more CTAs than tiles, a single tile, ragged splits.
const Case kCases[] = {{192, 16, 132}, {64, 16, 132}, {32, 16, 132}, {32, 48, 132},   {1, 16, 7}, {3, 2, 5},
                       {7, 1, 7},      {5, 3, 2},     {100, 17, 13}, {2374, 16, 132}, {1, 1, 1},  {9, 5, 45}};

TEST(StreamK, EveryUnitBelongsToOneCtaInOrderAndRangesAreEven) {
  for (const Case& c : kCases) {
    const int64_t units = c.tiles * c.kblocks;
    if (c.ctas > units) continue;  // the launcher takes at most one CTA per unit
    SCOPED_TRACE(testing::Message() << "tiles " << c.tiles << " kblocks " << c.kblocks << " ctas " << c.ctas);
    EXPECT_EQ(sk::begin(units, c.ctas, 0), 0);
    EXPECT_EQ(sk::begin(units, c.ctas, c.ctas), units);
    for (int i = 0; i < c.ctas; ++i) {
      const int64_t n = sk::begin(units, c.ctas, i + 1) - sk::begin(units, c.ctas, i);
      EXPECT_TRUE(n == units / c.ctas || n == units / c.ctas + 1) << "CTA " << i << " has " << n << " units";
    }
    for (int64_t u = 0; u < units; ++u) {
      const int i = sk::owner(units, c.ctas, u);
      ASSERT_GE(i, 0);
      ASSERT_LT(i, c.ctas);
      ASSERT_LE(sk::begin(units, c.ctas, i), u) << "unit " << u;
      ASSERT_LT(u, sk::begin(units, c.ctas, i + 1)) << "unit " << u;
    }
  }
}

// The walk of every CTA (its tiles and their K blocks) covers each tile's K blocks exactly once,
// in K order across the tile's pieces first_cta .. last_cta; the pieces' slots are distinct, below
// 2 ctas, and each CTA writes at most its two slots.
TEST(StreamK, WalksCoverEachTileOncePiecesHaveDistinctSlots) {
  for (const Case& c : kCases) {
    const int64_t units = c.tiles * c.kblocks;
    if (c.ctas > units) continue;
    SCOPED_TRACE(testing::Message() << "tiles " << c.tiles << " kblocks " << c.kblocks << " ctas " << c.ctas);
    std::vector<std::vector<std::pair<int, int>>> pieces(static_cast<size_t>(c.tiles));  // (kb0, cta)
    std::set<int> slots;
    for (int i = 0; i < c.ctas; ++i) {
      const sk::Range r = sk::range(units, c.ctas, c.kblocks, i);
      for (int64_t t = r.tile_begin(); t < r.tile_end(); ++t) {
        ASSERT_GT(r.nk(t), 0) << "CTA " << i << " tile " << t;
        ASSERT_GE(r.kb0(t), 0);
        ASSERT_LE(r.kb0(t) + r.nk(t), c.kblocks);
        pieces[static_cast<size_t>(t)].push_back({r.kb0(t), i});
        const bool cut = r.nk(t) < c.kblocks;
        if (cut) {
          const int s = sk::slot(units, c.ctas, c.kblocks, i, t);
          EXPECT_TRUE(s == 2 * i || s == 2 * i + 1) << "CTA " << i << " tile " << t;
          EXPECT_TRUE(slots.insert(s).second) << "slot " << s << " twice";
          // Its first piece starts at the range's start, its last piece ends at the range's end.
          if (s == 2 * i) EXPECT_EQ(t * c.kblocks + r.kb0(t), r.u0);
          else EXPECT_EQ(t * c.kblocks + r.kb0(t) + r.nk(t), r.u1);
        }
      }
    }
    for (int64_t t = 0; t < c.tiles; ++t) {
      const auto& p = pieces[static_cast<size_t>(t)];
      ASSERT_FALSE(p.empty()) << "tile " << t;
      const int lo = sk::first_cta(units, c.ctas, c.kblocks, t), hi = sk::last_cta(units, c.ctas, c.kblocks, t);
      ASSERT_EQ(static_cast<int>(p.size()), hi - lo + 1) << "tile " << t;
      int kb = 0;
      for (size_t j = 0; j < p.size(); ++j) {
        EXPECT_EQ(p[j].second, lo + static_cast<int>(j)) << "tile " << t << ": pieces in CTA order";
        EXPECT_EQ(p[j].first, kb) << "tile " << t << ": pieces in K order";
        kb += sk::range(units, c.ctas, c.kblocks, p[j].second).nk(t);
      }
      EXPECT_EQ(kb, c.kblocks) << "tile " << t;
    }
  }
}

}  // namespace
}  // namespace fp8rl
