// A linear map of every token by one weight, with an optional bias: out = in W (+ b), W of shape
// (w_in, w_out), b a (1, w_out) parameter when the node owns two.
//
// Derivatives (docs/derivation.md §4.2): d out_t = d in_t W + in_t dW + db. The weight enters with
// the factor vec_t = in_t (on W's rows), U_t = I; the bias with vec_t = [1], U_t = I; a factor at
// the input moves to W^T U_t. Its one piece of curvature is bilinear, <g, d in dW> (the input and
// the weight both vary): for a parameter i reaching the input, Gamma_t = U_i,t^T with g_t on W's
// columns. out is linear in b: the bias has no curvature of its own.
#pragma once

#include "blockhess/eigen.hpp"
#include "blockhess/engine/graph.hpp"
#include "blockhess/finite.hpp"
#include "blockhess/engine/rows/entries.hpp"
#include "blockhess/parallel_product.hpp"

namespace blockhess::engine {

template <class T>
class LinearNode final : public Node<T> {
 public:
  explicit LinearNode(const char* stage) : stage_(stage) {}

  void forward(Graph<T>& g) override {
    const index_t n = g.tokens();
    MapM<T> out(g.value_out(this->output), n, w_out(g));
    product(g.backend(), out, MapC<T>(g.value(in()), n, w_in(g)), W(g), T(1), false);
    if (has_bias()) g.backend().run(rows::AddBias<T>{g.weight(bias_param()), out.data(), w_out(g)}, n * w_out(g));
    require_finite(g.backend(), g.value(this->output), n * w_out(g), stage_);
  }

  void vjp(Graph<T>& g) const override {
    const index_t n = g.tokens();
    const MapC<T> gout(g.cotangent(this->output), n, w_out(g));
    if (g.varies(in())) {
      const Slot<T> s = g.cotangent_slot(in());
      product(g.backend(), MapM<T>(s.data, n, w_in(g)), gout, W(g).transpose(), T(1), s.add);
    }
    if (T* grad = g.gradient_out(param()))
      product(g.backend(), MapM<T>(grad, w_in(g), w_out(g)), MapC<T>(g.value(in()), n, w_in(g)).transpose(), gout, T(1), false);
    if (has_bias())
      if (T* grad = g.gradient_out(bias_param())) token_sums(g, gout.data(), w_out(g), grad);
  }

  LinearUse<T> linear_use(const Graph<T>& g, int p) const override {
    if (p == param()) return {g.value(in()), g.cotangent(this->output)};
    if (has_bias() && p == bias_param()) return {nullptr, g.cotangent(this->output)};
    return {};
  }

  void push(Graph<T>& g) const override {
    const index_t n = g.tokens();
    g.set_factors(this->output, left_multiply_weight(g.backend(), g.factors(in()), n,
                                                                     MatrixView<const T>{g.weight(param()), w_in(g), w_out(g), w_out(g), true}));
    if (g.selected(param()))
      g.set_factor(this->output, g.whole(param()),
                   entering<T>(kron::Split{w_in(g), w_out(g), true}, g.value_copy(in()), w_out(g)));
    if (has_bias() && g.selected(bias_param()))
      g.set_factor(this->output, g.whole(bias_param()),
                   entering<T>(kron::Split{1, w_out(g), true}, filled(g.backend(), n, T(1)), w_out(g)));
  }

  void curvature(const Graph<T>& g, Terms<T>& terms) const override {
    if (!g.selected(param())) return;
    const kron::Split by_columns{w_in(g), w_out(g), false};  // g_t on W's columns, W's rows meet U_t
    const T* gout = g.cotangent(this->output);
    const int weight = g.whole(param());
    for (int p = 0; p < g.num_pieces(); ++p) {
      const Factor<T>& f = g.factor(in(), p);
      if (!f.present) continue;
      const index_t wi = w_in(g), r = f.n_mat();
      if (f.right) {  // U_t^T = R_t^T G_t^T
        terms.kron.push_back(KronTerm<T>{p, weight, f.split, by_columns, f.vec->data(), gout,
                                         [f, wi, r](index_t t, T* out) {
                                           ColMat<T> G;
                                           f.materialise_moving(t, G);
                                           MapM<T>(out, r, wi).noalias() = f.right_t(t).transpose() * G.transpose();
                                         },
                                         false});
      } else if (f.form == Form::dense) {
        terms.kron.push_back(KronTerm<T>{p, weight, f.split, by_columns, f.vec->data(), gout,
                                         [f, wi, r](index_t t, T* out) {
                                           MapM<T>(out, r, wi) = f.dense(t).transpose();
                                         },
                                         false});
      } else {
        terms.diagonal.push_back(DiagonalTerm<T>{p, weight, f.split, by_columns, f.vec->data(), gout,
                                                 f.form == Form::diagonal ? f.U->data() : nullptr});
      }
    }
  }

  bool token_local() const override { return true; }

  void jvp(const Graph<T>& g, Tangent<T>& tg) const override {
    const T* din = tg.in(in());
    const T* dW = tg.dW[static_cast<size_t>(param())];
    const T* db = has_bias() ? tg.dW[static_cast<size_t>(bias_param())] : nullptr;
    if (!din && !dW && !db) return;
    const index_t n = g.tokens();
    MapM<T> dout(tg.out(this->output, n * w_out(g)), n, w_out(g));
    if (din) product(g.backend(), dout, MapC<T>(din, n, w_in(g)), W(g), T(1), false);
    if (dW) product(g.backend(), dout, MapC<T>(g.value(in()), n, w_in(g)), MapC<T>(dW, w_in(g), w_out(g)), T(1), din != nullptr);
    if (!din && !dW) g.backend().run(rows::Zero<T>{dout.data()}, n * w_out(g));
    if (db) g.backend().run(rows::AddBias<T>{db, dout.data(), w_out(g)}, n * w_out(g));
  }

  // d(g W^T) = dg W^T + (curved) g dW^T;  d(in^T g) = in^T dg + (curved) d in^T g.
  void vjp_tangent(const Graph<T>& g, Tangent<T>& tg, bool curved) const override {
    const index_t n = g.tokens();
    const MapC<T> gout(g.cotangent(this->output), n, w_out(g)), dgout(tg.dcot[this->output].data(), n, w_out(g));
    const T* din = tg.in(in());
    const T* dW = tg.dW[static_cast<size_t>(param())];
    if (din) {
      const Slot<T> s = tg.dcot_slot(in(), n * w_in(g));
      MapM<T> dgin(s.data, n, w_in(g));
      product(g.backend(), dgin, dgout, W(g).transpose(), T(1), s.add);
      if (curved && dW) product(g.backend(), dgin, gout, MapC<T>(dW, w_in(g), w_out(g)).transpose(), T(1), true);
    }
    if (T* out = tg.dgrad[static_cast<size_t>(param())]) {
      MapM<T> o(out, w_in(g), w_out(g));
      product(g.backend(), o, MapC<T>(g.value(in()), n, w_in(g)).transpose(), dgout, T(1), false);
      if (curved && din) product(g.backend(), o, MapC<T>(din, n, w_in(g)).transpose(), gout, T(1), true);
    }
    if (has_bias())
      if (T* out = tg.dgrad[static_cast<size_t>(bias_param())]) token_sums(g, dgout.data(), w_out(g), out);
  }

 private:
  int in() const { return this->inputs[0]; }
  int param() const { return this->params[0]; }
  bool has_bias() const { return this->params.size() > 1; }
  int bias_param() const { return this->params[1]; }
  index_t w_in(const Graph<T>& g) const { return g.width(in()); }
  index_t w_out(const Graph<T>& g) const { return g.width(this->output); }
  MapC<T> W(const Graph<T>& g) const { return MapC<T>(g.weight(param()), w_in(g), w_out(g)); }

  const char* stage_;
};

}  // namespace blockhess::engine
