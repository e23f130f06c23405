// The working memory of the engine's calls, in elements: what each one allocates besides its
// result, estimated from the wired graph before any pass runs, so that a caller can refuse a call
// that would not fit. Each node and head states the buffers its own passes allocate
// (Node::footprint, Head::footprint, and for the per-token factors Node::factor_columns,
// entering_factor, passing_factor); this adds what the graph holds for them (values, cotangents,
// a product's tangents) and what the assembly holds. A slight over-count is intended: the estimate
// is a guard, not an accountant.
//
// The graph may be wired for its shapes only (Graph::input with no data, borrowed null weights);
// none of this reads a value.
#pragma once

#include <algorithm>
#include <vector>

#include "blockhess/config.hpp"
#include "blockhess/engine/graph.hpp"
#include "blockhess/engine/head.hpp"

namespace blockhess::engine {

enum class Call : int {
  gradient = 0,        // the loss and its gradient: a forward and a reverse pass
  loss_hessian = 1,    // the dense Hessian (or its part) over a selection (loss.hpp's loss_hessian)
  diagonal = 2,        // its diagonal (diagonal.hpp): one group of parameters' factors at a time
  products = 3,        // Hessian-vector products of `columns` columns (LossOperator)
  jacobian = 4,        // dZ/dW for the selected parameter (derivatives.hpp), no head
  output_hessian = 5,  // d2Z / dW_i dW_j for the selected pair (derivatives.hpp), no head
  forward = 6,         // the forward pass and what it keeps
  input_tangents = 7,  // `columns` forward tangents of the graph's input (derivatives.hpp), no head
};

template <class T>
class WorkingMemory {
 public:
  // head: null for the calls without a loss (jacobian, output_hessian).
  WorkingMemory(const Graph<T>& g, const Head<T>* head, const std::vector<bool>& selected, index_t threads)
      : g_(g), head_(head), selected_(selected), threads_(std::max<index_t>(1, threads)) {}

  index_t of(Call call, Part part, index_t columns) const {
    switch (call) {
      case Call::gradient:
        return kept(false);
      case Call::products:
        return products(columns);
      case Call::loss_hessian:
        return std::max(factored(part, false), identity_products());
      case Call::diagonal:
        return std::max(factored(part, true), identity_products());
      case Call::jacobian:
        return factored(Part::functional, false);
      case Call::output_hessian:  // and the (P, P) target it assembles each output entry's Hessian into
        return factored(Part::functional, false) + selected_size() * selected_size();
      case Call::forward:
        return kept(false);
      case Call::input_tangents:
        return input_tangents(columns);
    }
    return 0;
  }

 private:
  // The values, the parameters' copies, every node's caches, the reverse pass's cotangents and the
  // head's (with its site where the outer part is formed).
  index_t kept(bool site) const {
    const index_t n = g_.tokens();
    index_t total = 0;
    for (int v = 0; v < g_.num_values(); ++v) total += n * g_.width(v) * (g_.varies(v) ? 2 : 1);
    for (int p = 0; p < g_.num_params(); ++p) total += g_.parameter(p).size();
    for (const auto& node : g_.nodes()) {
      const Footprint f = node->footprint(g_);
      total += f.forward + f.reverse;
    }
    if (head_) total += n * g_.width(g_.output()) + head_->footprint(g_, site);
    return total;
  }

  index_t selected_size() const {
    index_t P = 0;
    for (int p = 0; p < g_.num_params(); ++p)
      if (selected_[static_cast<size_t>(p)]) P += g_.parameter(p).size();
    return P;
  }

  // One product in flight: every varying value's tangent and its cotangent's, the nodes' scratch,
  // and its column and result.
  index_t per_product() const {
    index_t total = 2 * selected_size();
    for (int v = 0; v < g_.num_values(); ++v)
      if (g_.varies(v)) total += 2 * g_.tokens() * g_.width(v);
    for (const auto& node : g_.nodes()) total += node->footprint(g_).tangent;
    return total;
  }

  // The operator (its caches), and a product in flight per thread, at most one per column.
  index_t products(index_t columns) const {
    return kept(false) + per_product() * std::max<index_t>(1, std::min(columns, threads_));
  }

  // input_tangents (derivatives.hpp): a tangent in flight per thread, at most one per column, each
  // every value's tangent (the input's the seed) and the nodes' scratch.
  index_t input_tangents(index_t columns) const {
    index_t one = 0;
    for (int v = 0; v < g_.num_values(); ++v) one += g_.tokens() * g_.width(v);
    for (const auto& node : g_.nodes()) one += node->footprint(g_).tangent;
    return kept(false) + one * std::max<index_t>(1, std::min(columns, threads_));
  }

  // Products::unit_columns (loss.hpp), where the factors do not reach: a unit vector and its
  // column per thread beside the products.
  index_t identity_products() const { return products(threads_) + 2 * selected_size() * threads_; }

  // The factored assembly: the caches, every node's curvature terms, kron::accumulate's chunks,
  // and the selected parameters' factors at every value downstream of where they enter: all
  // groups at once for a dense Hessian, the largest group alone for the diagonal. The diagonal's
  // groups below a token-local cut stop there, where the cut's site (one (w, w) Omega a token) and,
  // while it is formed, a probe factor pushed through the nodes above are held (loss.hpp).
  index_t factored(Part part, bool one_group_at_a_time) const {
    const bool outer = head_ && part != Part::functional, functional = part != Part::outer;
    index_t total = kept(outer);
    index_t widest = 1;
    for (int v = 0; v < g_.num_values(); ++v) widest = std::max(widest, g_.width(v));
    for (int p = 0; p < g_.num_params(); ++p) widest = std::max({widest, g_.parameter(p).rows, g_.parameter(p).cols});
    constexpr index_t kron_chunk = index_t(1) << 22;  // kron::accumulate's entries a chunk, a few chunks in flight
    total += 3 * std::min(g_.tokens() * widest * widest, kron_chunk);
    if (functional)
      for (const auto& node : g_.nodes()) total += node->footprint(g_).curvature;
    const bool cut = one_group_at_a_time && !(head_ && head_->couples_tokens());
    const std::vector<int> cuts = cut ? g_.token_local_cuts(selected_) : std::vector<int>{};
    std::vector<int> used;  // the cuts the selected groups stop at
    index_t factors = 0, scratch = 0;
    for (const auto& node : g_.nodes()) {
      index_t entering = 0;
      int last = -1;
      for (int p : node->params)
        if (selected_[static_cast<size_t>(p)]) entering += node->entering_factor(g_, p), last = std::max(last, g_.last_use(p));
      if (entering == 0) continue;
      const int cut_at = Graph<T>::cut_at_or_after(cuts, last);
      const int stop = cut_at < 0 ? static_cast<int>(g_.nodes().size()) : cut_at;
      if (cut_at >= 0 && std::find(used.begin(), used.end(), stop) == used.end()) used.push_back(stop);
      const index_t group = entering + downstream(*node, node->factor_columns(g_), stop, scratch);
      factors = one_group_at_a_time ? std::max(factors, group) : factors + group;
    }
    for (int k : used) {
      const Node<T>& at = *g_.nodes()[static_cast<size_t>(k)];
      const index_t w = g_.width(at.output);
      total += g_.tokens() * w * w;
      factors = std::max(factors, downstream(at, w, static_cast<int>(g_.nodes().size()), scratch));
    }
    total += factors + scratch;
    if (outer && head_->couples_tokens()) {  // assemble.hpp's token-summed Jacobian slabs, a few samples at a time
      const index_t d = g_.width(g_.output());
      total += 2 * std::max<index_t>(1, std::min(g_.samples(), 128 / std::max<index_t>(1, d))) * d * selected_size();
    }
    return total;
  }

  // A factor of r columns entering at `from`'s output: its G_t at that value and every value
  // downstream up to node `last`'s, and what it costs passing each node on the way; `scratch`
  // becomes at least each of those nodes' push scratch (Node::push_scratch), held one push at a time.
  index_t downstream(const Node<T>& from, index_t r, int last, index_t& scratch) const {
    std::vector<char> reached(static_cast<size_t>(g_.num_values()), 0);
    reached[static_cast<size_t>(from.output)] = 1;
    index_t total = g_.tokens() * r * g_.width(from.output);
    for (const auto& node : g_.nodes()) {
      if (node->index <= from.index || node->index > last) continue;
      const bool moved = std::any_of(node->inputs.begin(), node->inputs.end(),
                                     [&](int v) { return reached[static_cast<size_t>(v)] != 0; });
      if (!moved) continue;
      reached[static_cast<size_t>(node->output)] = 1;
      total += g_.tokens() * r * g_.width(node->output) + node->passing_factor(g_, r);
      scratch = std::max(scratch, node->push_scratch(g_, r));
    }
    return total;
  }

  const Graph<T>& g_;
  const Head<T>* head_;
  std::vector<bool> selected_;
  index_t threads_;
};

}  // namespace blockhess::engine
