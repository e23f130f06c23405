// A loss at the graph's output Z (tokens x width), averaged over the batch: the scalar every loss
// derivative starts from. Like a node (graph.hpp), a head implements once what the engine asks of it:
//   forward      the loss, and its gradient dl/dZ (the reverse pass's seed);
//   curvature    its second derivative at Z as a site (terms.hpp): the outer (Gauss-Newton) part of
//                the Hessian, J^T H_l J (docs/derivation.md §4.1);
//   vjp_tangent  that second derivative applied to a tangent dZ: the Hessian-vector product's seed,
//                with no d x d block formed;
//   root_column  one column of a square root of it, S_c with d2l/dZ^2 = sum_c S_c S_c^T, block by
//                block (a token's, or a sample's where the loss couples its tokens): the seeds that
//                methods backpropagating the loss's curvature take (K-FAC, kfac.hpp).
// A new loss is one head (heads/) and one entry of the registry (heads.hpp); nothing else switches
// on a loss.
#pragma once

#include <cstdint>
#include <stdexcept>
#include <string>

#include "blockhess/backend_buffer.hpp"
#include "blockhess/config.hpp"
#include "blockhess/engine/graph.hpp"
#include "blockhess/engine/rows/entries.hpp"
#include "blockhess/engine/terms.hpp"

namespace blockhess::engine {

// The full Hessian, its outer (Gauss-Newton) part or its functional part (docs/derivation.md §4.1).
enum class Part : int { full = 0, outer = 1, functional = 2 };

template <class T>
class Head {
 public:
  virtual ~Head() = default;
  // The loss at g's output (its forward pass done); writes dl/dZ, (tokens, width), into gZ.
  virtual T forward(const Graph<T>& g, T* gZ) = 0;
  // Its second derivative at Z, after forward: a Site, or a PooledSite where it couples tokens.
  virtual void curvature(const Graph<T>& g, Terms<T>& terms) const = 0;
  // dgZ = (d2l/dZ^2) dZ, after forward.
  virtual void vjp_tangent(const Graph<T>& g, const T* dZ, T* dgZ) const = 0;
  // The number of columns of the square root (the width of a row's loss block), and column c of
  // it, (tokens, width), into S: for each loss term its block's square root
  // sqrt(w) (diag sqrt(p) - p sqrt(p)^T) (cross-entropy, w its weight in the mean; MSE sqrt(2 w) I),
  // the same column c of every term's block at once. After forward.
  virtual index_t root_columns(const Graph<T>& g) const = 0;
  virtual void root_column(const Graph<T>& g, index_t c, T* S) const = 0;
  // Whether its site couples the tokens of a sample: the parameters' factors are then needed at Z
  // itself (Graph::push_factors(true)), not pulled back through Z's producer.
  virtual bool couples_tokens() const { return false; }
  // Its working memory in elements (engine/working_memory.hpp): what forward keeps beside dl/dZ,
  // and with `site` its curvature's Omegas.
  virtual index_t footprint(const Graph<T>& g, bool site) const = 0;

 protected:
  // Storage for the loss of each of n rows (a head's row operation writes them), in g's backend.
  T* row_losses(const Graph<T>& g, index_t n) {
    row_losses_.resize(g.backend(), n + 1);
    return row_losses_.data();
  }
  // Their sum, row after row, read back on the host: the loss.
  T total_loss(const Graph<T>& g, index_t n) {
    T* total = row_losses_.data() + n;
    g.backend().run(rows::ColumnSums<T>{row_losses_.data(), nullptr, total, n, 1, false}, 1);
    T value;
    g.backend().download(&value, total, sizeof(T));
    return value;
  }

 private:
  BackendBuffer<T> row_losses_;  // n row losses and their sum
};

// A cross-entropy head's class index k, checked against its number of classes.
inline void require_class(std::int64_t k, index_t classes) {
  if (k < 0 || k >= classes)
    throw std::invalid_argument("loss: class index " + std::to_string(k) + " is out of range [0, " +
                                std::to_string(classes) + ")");
}

}  // namespace blockhess::engine
