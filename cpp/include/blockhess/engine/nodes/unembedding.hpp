// A language model's LM head tied to its embedding: the logits of every token against the
// vocabulary, out = in W_E^T, with W_E (vocab, d) the embedding's own parameter (embedding.hpp),
// used a second time: one parameter, its gradient and H v the sum over both uses (Graph's slots).
//
// Derivatives as a linear map's (linear.hpp) with the weight transposed:
//   reverse   g_in = g W_E,  g_W = g^T in;
//   tangent   d g_in = dg W_E + g dW_E,  d g_W = dg^T in + g^T d in  (the second terms: its
//             bilinear curvature <g, d in dW_E^T>).
// A factor at the input moves to W_E U_t. W_E's own factors, and so its bilinear term, would also
// need the embedding's, which the attention refuses (embedding.hpp): a dense Hessian or diagonal
// over W_E is refused at the embedding's push, before this node's.
#pragma once

#include <stdexcept>

#include "blockhess/eigen.hpp"
#include "blockhess/engine/graph.hpp"
#include "blockhess/finite.hpp"
#include "blockhess/parallel_product.hpp"

namespace blockhess::engine {

template <class T>
class UnembeddingNode final : public Node<T> {
 public:
  void forward(Graph<T>& g) override {
    const index_t n = g.tokens();
    product(g.backend(), MapM<T>(g.value_out(this->output), n, vocab(g)), X(g), W(g).transpose(), T(1), false);
    require_finite(g.backend(), g.value(this->output), n * vocab(g), "language model: the logits");
  }

  void vjp(Graph<T>& g) const override {
    const index_t n = g.tokens();
    const MapC<T> gout(g.cotangent(this->output), n, vocab(g));
    if (g.varies(in())) {
      const Slot<T> s = g.cotangent_slot(in());
      product(g.backend(), MapM<T>(s.data, n, d(g)), gout, W(g), T(1), s.add);
    }
    const Slot<T> s = g.gradient_slot(param());
    if (s.data) product(g.backend(), MapM<T>(s.data, vocab(g), d(g)), gout.transpose(), X(g), T(1), s.add);
  }

  void push(Graph<T>& g) const override {
    if (g.selected(param())) throw std::logic_error("engine: the LM head's weight is the embedding's, refused there");
    bool any = false;
    for (const Factor<T>* f : g.factors(in())) any = any || f->present;
    if (!any) return;
    // W_E^T (d, vocab): W_E read column by column.
    g.set_factors(this->output, left_multiply_weight(g.backend(), g.factors(in()), g.tokens(),
                                                     MatrixView<const T>{g.weight(param()), d(g), vocab(g), d(g), false}));
  }

  // push(): W_E^T laid out by rows, for an identity or diagonal factor (the final norm's own).
  index_t push_scratch(const Graph<T>& g, index_t) const override { return d(g) * vocab(g); }

  // W_E applied transposed to every token (LinearUse): logits_t = x_t W_E^T.
  LinearUse<T> linear_use(const Graph<T>& g, int) const override {
    return {g.value(in()), g.cotangent(this->output), nullptr, /*transposed=*/true};
  }


  // Its only curvature is bilinear in the input and W_E, which needs W_E selected (refused above).
  void curvature(const Graph<T>&, Terms<T>&) const override {}

  // Token-local and, with W_E never carrying factors (above), linear in its input alone: a site at
  // the logits is W_E^T Omega_t W_E at its input (d, d), where the factors meet it instead of being
  // carried to the vocabulary's width.
  bool token_local() const override { return true; }
  bool pulls_sites() const override { return true; }
  void pull_site(const Graph<T>& g, index_t /*t*/, const T* omega_out, T* omega_in) const override {
    const Mat<T> omega_W = MapC<T>(omega_out, vocab(g), vocab(g)) * W(g);
    MapM<T>(omega_in, d(g), d(g)).noalias() = W(g).transpose() * omega_W;
  }

  void jvp(const Graph<T>& g, Tangent<T>& tg) const override {
    const T* din = tg.in(in());
    const T* dW = tg.dW[static_cast<size_t>(param())];
    if (!din && !dW) return;
    const index_t n = g.tokens();
    MapM<T> dout(tg.out(this->output, n * vocab(g)), n, vocab(g));
    if (din) product(g.backend(), dout, MapC<T>(din, n, d(g)), W(g).transpose(), T(1), false);
    if (dW) product(g.backend(), dout, X(g), MapC<T>(dW, vocab(g), d(g)).transpose(), T(1), din != nullptr);
  }

  void vjp_tangent(const Graph<T>& g, Tangent<T>& tg, bool curved) const override {
    const index_t n = g.tokens();
    const MapC<T> gout(g.cotangent(this->output), n, vocab(g));
    const MapC<T> dgout(tg.dcot[static_cast<size_t>(this->output)].data(), n, vocab(g));
    const T* din = tg.in(in());
    const T* dW = tg.dW[static_cast<size_t>(param())];
    if (din) {
      const Slot<T> s = tg.dcot_slot(in(), n * d(g));
      MapM<T> dgin(s.data, n, d(g));
      product(g.backend(), dgin, dgout, W(g), T(1), s.add);
      if (curved && dW) product(g.backend(), dgin, gout, MapC<T>(dW, vocab(g), d(g)), T(1), true);
    }
    const Slot<T> s = tg.dgrad_slot(param());
    if (s.data) {
      MapM<T> o(s.data, vocab(g), d(g));
      product(g.backend(), o, dgout.transpose(), X(g), T(1), s.add);
      if (curved && din) product(g.backend(), o, gout.transpose(), MapC<T>(din, n, d(g)), T(1), true);
    }
  }

 private:
  int in() const { return this->inputs[0]; }
  int param() const { return this->params[0]; }
  index_t d(const Graph<T>& g) const { return g.width(in()); }
  index_t vocab(const Graph<T>& g) const { return g.width(this->output); }
  MapC<T> X(const Graph<T>& g) const { return MapC<T>(g.value(in()), g.tokens(), d(g)); }
  MapC<T> W(const Graph<T>& g) const { return MapC<T>(g.weight(param()), vocab(g), d(g)); }
};

}  // namespace blockhess::engine
