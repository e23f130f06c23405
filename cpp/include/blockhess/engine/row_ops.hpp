// The engine's per-token work as row operations: each a plain struct of pointers, sizes and flags
// whose operator()(begin, end) does items [begin, end) (an entry, or a token's row, as the op says)
// with the BLOCKHESS_HD element functions, so one definition serves the host (cpu_backend.hpp: the
// items split over the core's threads) and the GPU (cuda/src/backend.cu: one thread per item). Its
// cost() is its work per item in multiply-adds (what decides whether the host splits it).
//
// An op whose items need working rows has scratch_size(), the entries an item needs, and takes
// operator()(begin, end, scratch): the backend hands it that much scratch, which the op may reuse
// item after item (on the host one piece a thread, on the GPU one an item).
//
// A backend runs each op through Backend::run (backend.hpp), one virtual overload per op: the list
// below is the one place an op is named, and each backend instantiates it for every op there.
#pragma once

#include <type_traits>
#include <utility>

namespace blockhess::engine::rows {

// Whether Op has scratch_size() (and takes scratch).
template <class Op, class = void>
inline constexpr bool kScratch = false;
template <class Op>
inline constexpr bool kScratch<Op, std::void_t<decltype(std::declval<const Op&>().scratch_size())>> = true;

// entry by entry (rows/entries.hpp)
template <class T>
struct ScaleEntries;
template <class T>
struct ScaleBy;
template <class T>
struct Zero;
template <class T>
struct SumEntries;
template <class T>
struct WriteEntries;
template <class T>
struct TransposeRows;
template <class T>
struct AddBias;
template <class T>
struct ColumnSums;
template <class T>
struct SampleSums;
template <class T>
struct ClassTokenRows;
template <class T>
struct GatherRows;
template <class T>
struct ScatterRows;
// the tangent factors' (rows/factors.hpp)
template <class T>
struct Fill;
template <class T>
struct WeightRows;
template <class T>
struct ScaleFactorRows;
template <class T>
struct DiagonalTimesRows;
template <class T>
struct AddFactors;
template <class T>
struct JacobianColumns;
template <class T>
struct FactorOuterRows;
template <class T>
struct CrossLayoutRows;
template <class T>
struct BlockDiagonalRows;
template <class T>
struct UnitColumn;
template <class T>
struct WriteStrided;
// the pointwise activation's (rows/pointwise.hpp)
template <class T>
struct ActivationForward;
template <class T>
struct ActivationCotangentTangent;
// the row norms' (rows/norm.hpp)
template <class T>
struct NormalizeRows;
template <class T>
struct NormJacobianRows;
template <class T>
struct ScaleColumns;
template <class T>
struct NormTangentRows;
template <class T>
struct NormVjpRows;
template <class T>
struct NormCotangentTangentRows;
// the losses' (rows/heads.hpp)
template <class T>
struct MseRows;
template <class T>
struct CrossEntropyRows;
template <class T>
struct CrossEntropyTangentRows;
template <class T>
struct PooledCrossEntropyRows;
template <class T>
struct PooledBlockEntries;
template <class T>
struct PooledBlockApply;
// the attention's row softmax (rows/softmax.hpp)
template <class T>
struct SoftmaxRows;
template <class T>
struct SoftmaxVjpRows;
template <class T>
struct SoftmaxCotangentTangentRows;
template <class T>
struct SoftmaxJacobianColumns;
// the attention's factors and input Jacobian (rows/attention.hpp)
template <class T>
struct WeightedRows;
template <class T>
struct HeadRows;
template <class T>
struct ScaledColumns;
template <class T>
struct AttentionInputRows;
}  // namespace blockhess::engine::rows

// X(op) for every row operation.
#define BLOCKHESS_ROW_OPS(X)      \
  X(ScaleEntries)                 \
  X(ScaleBy)                      \
  X(Zero)                         \
  X(SumEntries)                   \
  X(WriteEntries)                 \
  X(TransposeRows)                \
  X(AddBias)                      \
  X(ColumnSums)                   \
  X(SampleSums)                   \
  X(ClassTokenRows)               \
  X(GatherRows)                   \
  X(ScatterRows)                  \
  X(Fill)                         \
  X(WeightRows)                   \
  X(ScaleFactorRows)              \
  X(DiagonalTimesRows)            \
  X(AddFactors)                   \
  X(JacobianColumns)              \
  X(FactorOuterRows)              \
  X(CrossLayoutRows)              \
  X(BlockDiagonalRows)            \
  X(UnitColumn)                   \
  X(WriteStrided)                 \
  X(ActivationForward)            \
  X(ActivationCotangentTangent)   \
  X(NormalizeRows)                \
  X(NormJacobianRows)             \
  X(ScaleColumns)                 \
  X(NormTangentRows)              \
  X(NormVjpRows)                  \
  X(NormCotangentTangentRows)     \
  X(SoftmaxRows)                  \
  X(SoftmaxVjpRows)               \
  X(SoftmaxCotangentTangentRows)  \
  X(SoftmaxJacobianColumns)       \
  X(WeightedRows)                 \
  X(HeadRows)                     \
  X(ScaledColumns)                \
  X(AttentionInputRows)           \
  X(MseRows)                      \
  X(CrossEntropyRows)             \
  X(CrossEntropyTangentRows)      \
  X(PooledCrossEntropyRows)       \
  X(PooledBlockEntries)           \
  X(PooledBlockApply)
