// The loss of a wired graph (a head at its output, head.hpp) and its derivatives with respect to the
// parameters: the value and gradient, the dense Hessian (or its outer / functional part) over a
// selection of parameters, its exact diagonal, and the Hessian as a matrix-free operator.
//
// Second differential of the loss l(Z(W)) (docs/derivation.md §4.1, with the corrected blocks of
// its §4.4):  d2l = dZ^T H_l dZ  (the outer, Gauss-Newton part: the head's site at Z)
//                 + the nodes' own second derivatives contracted with the reverse pass's cotangents
//                   (the functional part: Graph::curvature).
// Dense assembly (assemble.hpp), the diagonal (diagonal.hpp) and the product (Graph::hvp) consume
// the same terms; nothing P x P is formed for a product.
#pragma once

#include <algorithm>
#include <limits>
#include <map>
#include <memory>
#include <mutex>
#include <numeric>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include "blockhess/buffer.hpp"
#include "blockhess/config.hpp"
#include "blockhess/engine/assemble.hpp"
#include "blockhess/engine/diagonal.hpp"
#include "blockhess/engine/graph.hpp"
#include "blockhess/engine/head.hpp"
#include "blockhess/engine/terms.hpp"
#include "blockhess/finite.hpp"
#include "blockhess/parallel.hpp"

namespace blockhess::engine {

// The loss at g's output (its forward pass done) and the reverse pass run with its gradient: the
// cotangents every curvature term reads. Writes the gradient of every parameter (in the graph's
// order) into grad unless it is null.
template <class T>
T reverse_loss(Graph<T>& g, Head<T>& head, T* grad = nullptr) {
  const index_t n = g.tokens() * g.width(g.output());
  BackendBuffer<T> gZ(g.backend(), n);
  const T value = head.forward(g, gZ.data());
  // A target far outside Z's range can overflow the loss and its gradient.
  require_finite(&value, 1, "block: the loss value");
  require_finite(g.backend(), gZ.data(), n, "block: the loss gradient with respect to Z");
  const std::vector<bool> all(static_cast<size_t>(g.num_params()), true);
  index_t P = 0;
  const std::vector<index_t> off = g.offsets(all, &P);
  std::vector<T*> gradient(off.size(), nullptr);
  if (grad)
    for (size_t p = 0; p < off.size(); ++p) gradient[p] = grad + off[p];
  g.reverse(gZ.data(), std::move(gradient));
  if (grad) require_finite(g.backend(), grad, P, "block: the loss gradient");
  return value;
}

// The head's curvature (the outer part), computed once; empty for the functional part.
template <class T>
Terms<T> outer_terms(const Graph<T>& g, const Head<T>& head, Part part) {
  Terms<T> terms;
  if (part == Part::functional) return terms;
  g.require_host("the loss's curvature");
  head.curvature(g, terms);
  return terms;
}

// The terms of the loss Hessian's part: the nodes' curvature (functional) and the head's (outer).
template <class T>
Terms<T> loss_terms(const Graph<T>& g, const Terms<T>& outer, Part part) {
  Terms<T> terms;
  if (part != Part::outer) terms = g.curvature();
  terms.sites.insert(terms.sites.end(), outer.sites.begin(), outer.sites.end());
  terms.pooled.insert(terms.pooled.end(), outer.pooled.begin(), outer.pooled.end());
  return terms;
}

// The selected parameters' factors, pushed (to Z too where the head's outer site couples tokens).
template <class T>
void push_loss_factors(Graph<T>& g, const Head<T>& head, Part part, const std::vector<bool>& wrt) {
  g.select(wrt);
  g.push_factors(/*to_output=*/head.couples_tokens() && part != Part::functional);
}

// The selected parameters' Hessian-vector products over a graph whose forward and reverse passes
// are done (reverse_loss), matrix-free:
//   H v is the derivative of the gradient along v (forward over reverse, in closed form):
//   1. push the tangent v forward through the graph (every node's jvp);
//   2. carry the tangent of the reverse pass back. Each cotangent g_x = J_x^T g_y moves for two
//      reasons: its seed moves (dg_y), and the node's Jacobian moves with the primal (the node's
//      second derivatives contracted with g_y, or a bilinear term where two varying operands multiply).
// The outer part keeps only the first reason, seeded with dgZ = H_l dZ (Head::vjp_tangent); the
// functional part keeps only the second with dgZ = 0; their sum is the full product. Nothing here
// depends on v but the tangents, which each product in flight holds in a Tangent of its own, kept
// and reused (so that repeated products do not fault in fresh pages every time).
template <class T>
class Products {
 public:
  Products(const Graph<T>& g, const Head<T>& head, Part part, std::vector<index_t> offset, index_t size)
      : g_(g), head_(head), part_(part), offset_(std::move(offset)), size_(size) {}
  Products(const Products&) = delete;
  Products& operator=(const Products&) = delete;

  index_t size() const { return size_; }
  // The work of one product, for parallel_for's grain.
  index_t cost() const { return size_ * g_.tokens(); }

  // out = H v for one vector v of length size().
  void apply(const T* v, T* out) const {
    const ScratchLease lease(*this);
    const bool seeded = part_ != Part::functional, curved = part_ != Part::outer;
    auto seed = [&](const T* dZ, T* dgZ) {
      if (seeded) head_.vjp_tangent(g_, dZ, dgZ);
      return seeded;
    };
    g_.backend().run(rows::Zero<T>{out}, size_);  // a selected parameter that reaches nothing has zero rows
    g_.hvp(lease.scratch, offset_, v, seed, curved, out);
    require_finite(g_.backend(), out, size_, "block: the Hessian-vector product H v (a vector of smaller magnitude may fit)");
  }

  // out = H V for V of shape (size(), k), both row-major. Columns are independent products, run in
  // parallel; each is computed the same way whichever thread runs it (bit-reproducible).
  void apply_columns(const T* V, index_t k, T* out) const {
    const index_t P = size_;
    if (k == 1) return apply(V, out);
    g_.require_host("a product with several vectors at once");
    blockhess::detail::parallel_for(k, cost(), [&](index_t j) {
      Buffer<T> column(P), result(P);
      for (index_t i = 0; i < P; ++i) column[i] = V[i * k + j];
      apply(column.data(), result.data());
      for (index_t i = 0; i < P; ++i) out[i * k + j] = result[i];
    });
  }

  // H e_j for every j in [0, size()), the columns of the identity, in parallel: each product is
  // handed to take(j, column) as it is done (column: size() entries, valid during the call).
  template <class Take>
  void identity_columns(Take&& take) const {
    std::vector<index_t> every(static_cast<size_t>(size_));
    std::iota(every.begin(), every.end(), index_t(0));
    unit_columns(every, take);
  }
  // The same for the j in `which` only.
  template <class Take>
  void unit_columns(const std::vector<index_t>& which, Take&& take) const {
    const index_t P = size_;
    g_.require_host("products with columns of the identity");
    blockhess::detail::parallel_for(static_cast<index_t>(which.size()), cost(), [&](index_t k) {
      const index_t j = which[static_cast<size_t>(k)];
      Buffer<T> unit(P), column(P);  // zeroed
      unit[j] = T(1);
      apply(unit.data(), column.data());
      take(j, column.data());
    });
  }

 private:
  using Scratch = Tangent<T>;
  Scratch& acquire() const {
    std::lock_guard<std::mutex> lock(scratch_mutex_);
    if (idle_scratch_.empty()) {
      scratch_.push_back(std::make_unique<Scratch>());
      return *scratch_.back();
    }
    Scratch* ws = idle_scratch_.back();
    idle_scratch_.pop_back();
    return *ws;
  }
  void release(Scratch& ws) const {
    std::lock_guard<std::mutex> lock(scratch_mutex_);
    idle_scratch_.push_back(&ws);
  }
  // One product's hold on a Scratch, given back however the product ends.
  struct ScratchLease {
    explicit ScratchLease(const Products& p) : owner(p), scratch(p.acquire()) {}
    ~ScratchLease() { owner.release(scratch); }
    ScratchLease(const ScratchLease&) = delete;
    ScratchLease& operator=(const ScratchLease&) = delete;
    const Products& owner;
    Scratch& scratch;
  };

  const Graph<T>& g_;
  const Head<T>& head_;
  Part part_;
  std::vector<index_t> offset_;
  index_t size_ = 0;
  mutable std::mutex scratch_mutex_;
  mutable std::vector<std::unique_ptr<Scratch>> scratch_;
  mutable std::vector<Scratch*> idle_scratch_;
};

// The products of the loss Hessian over the selected parameters of g, its reverse pass done.
template <class T>
Products<T> selected_products(Graph<T>& g, const Head<T>& head, Part part, const std::vector<bool>& wrt) {
  g.select(wrt);
  index_t P = 0;
  std::vector<index_t> offset = g.offsets(wrt, &P);
  return Products<T>(g, head, part, std::move(offset), P);
}

// The symmetric (P, P) loss Hessian (or its part) over the selected parameters, written through
// `out` (HostHessian, or the GPU's DeviceHessian) from the per-token factors, the reverse pass done.
// FactorsDoNotReach where a selected parameter's factors cannot stay per token.
template <class T, class Out>
void assemble_factored(Graph<T>& g, const Head<T>& head, Part part, const std::vector<bool>& wrt, Out& out) {
  push_loss_factors(g, head, part, wrt);
  assemble(g, loss_terms(g, outer_terms(g, head, part), part), g.offsets(wrt), out);
}

// The same, the reverse pass run first. Returns the loss.
template <class T, class Out>
T loss_hessian_into(Graph<T>& g, Head<T>& head, Part part, const std::vector<bool>& wrt, Out& out) {
  const T value = reverse_loss(g, head);
  assemble_factored(g, head, part, wrt, out);
  return value;
}

// The parameters of `group` that wrt selects (a flag per parameter); all false where it selects none.
inline std::vector<bool> selected_in(const std::vector<int>& group, const std::vector<bool>& wrt) {
  std::vector<bool> some(wrt.size(), false);
  for (int p : group) some[static_cast<size_t>(p)] = wrt[static_cast<size_t>(p)];
  return some;
}

// Where every entry of the parameters `which` flags sits in the selection laid out by `offset`.
template <class T>
std::vector<index_t> entries_of(const Graph<T>& g, const std::vector<bool>& which, const std::vector<index_t>& offset) {
  std::vector<index_t> entries;
  for (int p = 0; p < g.num_params(); ++p)
    if (which[static_cast<size_t>(p)])
      for (index_t k = 0; k < g.parameter(p).size(); ++k) entries.push_back(offset[static_cast<size_t>(p)] + k);
  return entries;
}

// The selected parameters whose factors reach the output: each group of them (a node's,
// Graph::factor_groups) pushed alone, the ones whose push is refused (FactorsDoNotReach) left out.
template <class T>
std::vector<bool> reached_by_factors(Graph<T>& g, const Head<T>& head, Part part, const std::vector<bool>& wrt) {
  std::vector<bool> reached(wrt.size(), false);
  for (const std::vector<int>& group : g.factor_groups()) {
    const std::vector<bool> some = selected_in(group, wrt);
    if (std::find(some.begin(), some.end(), true) == some.end()) continue;
    try {
      push_loss_factors(g, head, part, some);
      for (int p : group) reached[static_cast<size_t>(p)] = reached[static_cast<size_t>(p)] || some[static_cast<size_t>(p)];
    } catch (const FactorsDoNotReach&) {
    }
    g.clear_factors();
  }
  return reached;
}

// Into host memory H (P x P). Where the per-token factors do not reach a selected parameter (a
// lower block of a stack, an embedding: FactorsDoNotReach), its rows and columns come from exact
// Hessian-vector products with those columns of the identity instead (docs/derivation.md §5.4),
// the block of the parameters they reach from the factors: H e_j is written as row j and as column
// j where the other index is reached, and a pair (i, j) of two unreached entries is set to the mean
// of H e_j[i] and H e_i[j], which agree to rounding, so that H is symmetric by construction.
template <class T>
T loss_hessian(Graph<T>& g, Head<T>& head, Part part, const std::vector<bool>& wrt, T* H) {
  index_t P = 0;
  const std::vector<index_t> offset = g.offsets(wrt, &P);
  const T value = reverse_loss(g, head);
  try {
    HostHessian<T> out{H, P};
    assemble_factored(g, head, part, wrt, out);
    return value;
  } catch (const FactorsDoNotReach&) {
    g.clear_factors();
  }
  const std::vector<bool> reached = reached_by_factors(g, head, part, wrt);
  std::fill_n(H, P * P, T(0));
  if (std::find(reached.begin(), reached.end(), true) != reached.end()) {
    HostHessian<T> out{H, P};  // the reached parameters' block, at their places in the selection
    push_loss_factors(g, head, part, reached);
    assemble(g, loss_terms(g, outer_terms(g, head, part), part), offset, out);
    g.clear_factors();
  }
  std::vector<bool> unreached(wrt.size(), false);
  for (size_t p = 0; p < wrt.size(); ++p) unreached[p] = wrt[p] && !reached[p];
  const std::vector<index_t> columns = entries_of(g, unreached, offset);
  std::vector<char> from_products(static_cast<size_t>(P), 0);
  for (index_t j : columns) from_products[static_cast<size_t>(j)] = 1;
  const Products<T> products = selected_products(g, head, part, wrt);
  products.unit_columns(columns, [&](index_t j, const T* column) { std::copy_n(column, P, H + j * P); });
  blockhess::detail::parallel_for(static_cast<index_t>(columns.size()), P, [&](index_t k) {
    const index_t j = columns[static_cast<size_t>(k)];
    for (index_t i = 0; i < P; ++i) {
      if (!from_products[static_cast<size_t>(i)]) {
        H[i * P + j] = H[j * P + i];
      } else if (i < j) {  // each pair of unreached entries once, by its larger index
        const T mean = (H[i * P + j] + H[j * P + i]) / T(2);
        H[i * P + j] = mean;
        H[j * P + i] = mean;
      }
    }
  });
  return value;
}

// The diagonal of that Hessian (P entries), exact, with no block of it formed: its trace and
// per-parameter traces at sizes where no (P, P) matrix fits. An entry (p, p) needs p's factors
// only, so it is formed a group of parameters at a time (one node's, which share their pushes:
// Graph::factor_groups): the factors held at once are one group's, not every selected parameter's.
// The entries of a group whose factors do not reach it (a lower block of a stack, an embedding)
// come from products with those columns of the identity instead (one product per entry,
// docs/derivation.md §5.4), refused (std::invalid_argument) when there are more than max_products.
// A group below a token-local cut that pays (Graph::token_local_cuts(wrt); none where the head
// couples tokens) pushes its factors up to the cut only and meets every site above it there,
// pulled back once per cut (site_at_cut).
template <class T>
T loss_hessian_diagonal(Graph<T>& g, Head<T>& head, Part part, const std::vector<bool>& wrt, T* diag,
                        index_t max_products = std::numeric_limits<index_t>::max()) {
  const T value = reverse_loss(g, head);
  Terms<T> outer = outer_terms(g, head, part);
  outer.sites = detail::settle_sites(g, std::move(outer.sites));  // pulled back once, not once per group
  index_t P = 0;
  const std::vector<index_t> offset = g.offsets(wrt, &P);
  std::fill_n(diag, P, T(0));
  std::vector<bool> unreached(wrt.size(), false);
  std::string reason;
  const std::vector<int> cuts = head.couples_tokens() ? std::vector<int>{} : g.token_local_cuts(wrt);
  std::map<int, Site<T>> at_cut;
  for (const std::vector<int>& group : g.factor_groups()) {
    const std::vector<bool> some = selected_in(group, wrt);
    if (std::find(some.begin(), some.end(), true) == some.end()) continue;
    int used = -1;
    for (int p : group) used = std::max(used, g.last_use(p));
    const int cut = Graph<T>::cut_at_or_after(cuts, used);
    try {
      if (cut < 0) {
        push_loss_factors(g, head, part, some);
        add_diagonal(g, loss_terms(g, outer, part), offset, diag);
        continue;
      }
      if (at_cut.find(cut) == at_cut.end()) at_cut.emplace(cut, site_at_cut(g, cut, part != Part::outer, outer.sites));
      g.select(some);
      g.push_factors_through(cut);
      Terms<T> terms = part != Part::outer ? g.curvature(cut) : Terms<T>{};
      terms.sites.push_back(at_cut.at(cut));
      add_diagonal(g, std::move(terms), offset, diag);
    } catch (const FactorsDoNotReach& refusal) {
      g.clear_factors();
      if (reason.empty()) reason = refusal.what();
      for (int p : group) unreached[static_cast<size_t>(p)] = unreached[static_cast<size_t>(p)] || some[static_cast<size_t>(p)];
    }
  }
  g.clear_factors();
  const std::vector<index_t> declined = entries_of(g, unreached, offset);  // from products
  if (static_cast<index_t>(declined.size()) > max_products)
    throw std::invalid_argument(reason + "; its exact diagonal then takes one Hessian-vector product per entry the "
                                "factors do not reach, " + std::to_string(declined.size()) + " above the limit of " +
                                std::to_string(max_products) + ": select fewer parameters (wrt) or estimate the "
                                "diagonal (exact=False)");
  if (!declined.empty()) {
    const Products<T> products = selected_products(g, head, part, wrt);
    products.unit_columns(declined, [&](index_t j, const T* column) { diag[j] = column[j]; });
  }
  require_finite(diag, P, "block: the Hessian's diagonal");
  return value;
}

// The loss Hessian (or its part) over the selected parameters as an operator, matrix-free
// (Products): the forward pass, the head and the reverse pass do not depend on v: they run once, at
// construction, and every product reuses them.
template <class T>
class LossOperator {
 public:
  LossOperator(std::unique_ptr<Graph<T>> g, std::unique_ptr<Head<T>> head, Part part, const std::vector<bool>& wrt)
      : g_(std::move(g)), head_(std::move(head)), value_(reverse_loss(*g_, *head_)),
        products_(selected_products(*g_, *head_, part, wrt)) {}

  index_t size() const { return products_.size(); }
  T loss_value() const { return value_; }
  void apply(const T* v, T* out) const { products_.apply(v, out); }
  void apply_columns(const T* V, index_t k, T* out) const { products_.apply_columns(V, k, out); }

 private:
  std::unique_ptr<Graph<T>> g_;
  std::unique_ptr<Head<T>> head_;
  T value_;
  Products<T> products_;
};

}  // namespace blockhess::engine
