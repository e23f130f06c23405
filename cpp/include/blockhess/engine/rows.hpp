// Every row operation's definition (the list: engine/row_ops.hpp), for the backends that run them.
#pragma once

#include "blockhess/engine/row_ops.hpp"
#include "blockhess/engine/rows/attention.hpp"
#include "blockhess/engine/rows/entries.hpp"
#include "blockhess/engine/rows/factors.hpp"
#include "blockhess/engine/rows/heads.hpp"
#include "blockhess/engine/rows/norm.hpp"
#include "blockhess/engine/rows/pointwise.hpp"
#include "blockhess/engine/rows/softmax.hpp"
